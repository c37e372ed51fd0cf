//! `<VAR>_FILE`: a secret setting read from the file an environment variable names, as
//! orchestrators hand secrets over (a Kubernetes Secret or a Docker secret mounted as
//! files). `CLICKAGG__REDIS__PASSWORD_FILE=/run/secrets/redis-password` sets
//! `redis.password` to that file's content, without its trailing newline, at the
//! precedence of the environment (over the TOML file, under the flags).
//!
//! Only the settings in [`SECRET_KEYS`] take a `_FILE` variable; for any other key it is
//! an unknown setting like every misspelt one. Errors name the variables and the path,
//! never the content.

use std::collections::BTreeMap;

use figment::value::Value;

use super::ConfigError;

/// The settings that hold secrets and may be read from a file (`<VAR>_FILE`): one list,
/// for the loader, the docs and the tests.
pub const SECRET_KEYS: &[&str] = &[
    "kafka.sasl_password",
    "kafka.ssl_key_password",
    "kafka.oauth_client_secret",
    "redis.password",
    "redis.url",
    "clickhouse.password",
    "clickhouse.url",
    "dedup.fingerprint_key",
];

/// The environment variable of a dotted key: `redis.url` → `CLICKAGG__REDIS__URL`.
pub fn var_name(key: &str) -> String {
    format!("CLICKAGG__{}", key.replace('.', "__").to_ascii_uppercase())
}

/// Whether `key` (dotted, as the environment provider yields it, any case) is the `_FILE`
/// variable of a secret setting: the loader takes it out of the environment layer.
pub fn is_file_key(key: &str) -> bool {
    SECRET_KEYS.iter().any(|k| key.eq_ignore_ascii_case(&format!("{k}_file")))
}

/// The secret settings that `vars` (dotted keys, any case, and their values: the
/// environment layer) name files for, each with the file's content as a string value.
pub fn read(vars: &[(String, String)]) -> Result<Vec<(&'static str, Value)>, ConfigError> {
    let vars: BTreeMap<String, &str> = vars.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.as_str())).collect();
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for &key in SECRET_KEYS {
        let Some(&path) = vars.get(&format!("{key}_file")) else { continue };
        let var = var_name(key);
        if vars.contains_key(key) {
            problems.push(format!("{var} and {var}_FILE are both set: keep one"));
            continue;
        }
        match std::fs::read_to_string(path) {
            Ok(content) => out.push((key, Value::from(without_trailing_newline(content)))),
            // The I/O error says why (missing, permissions, not UTF-8), never what it read.
            Err(e) => problems.push(format!("{var}_FILE names {path}, which cannot be read: {e}")),
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(ConfigError::Invalid(problems.join("; ")))
    }
}

/// The content with one trailing newline (`\n` or `\r\n`) removed: what `echo` and most
/// editors add; any other whitespace is part of the secret.
fn without_trailing_newline(mut content: String) -> String {
    if content.ends_with('\n') {
        content.pop();
        if content.ends_with('\r') {
            content.pop();
        }
    }
    content
}

#[cfg(test)]
// figment's `Jail` closures return its (large) error type; that is its API, not ours.
#[allow(clippy::result_large_err)]
mod tests {
    use std::path::Path;

    use super::super::Settings;
    use super::*;

    /// Loads `vars` (plus each `(var, content)` of `files` as `<var>_FILE` pointing at a
    /// real file holding `content`).
    fn load(vars: &[(&str, &str)], files: &[(&str, &str)]) -> Result<Settings, String> {
        let dir = tempfile::tempdir().unwrap();
        let mut all: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        for (i, (var, content)) in files.iter().enumerate() {
            let path = dir.path().join(format!("secret-{i}"));
            std::fs::write(&path, content).unwrap();
            all.push((format!("{var}_FILE"), path.display().to_string()));
        }
        Settings::load_with_vars(None, vec![], all.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .map_err(|e| e.to_string())
    }

    /// The value a secret key holds in `s`, exposed.
    fn exposed(s: &Settings, key: &str) -> Option<String> {
        let secret = |o: &Option<crate::secrets::Secret>| o.as_ref().map(|s| s.expose().to_string());
        match key {
            "kafka.sasl_password" => secret(&s.kafka.sasl_password),
            "kafka.ssl_key_password" => secret(&s.kafka.ssl_key_password),
            "kafka.oauth_client_secret" => secret(&s.kafka.oauth_client_secret),
            "redis.password" => secret(&s.redis.password),
            "redis.url" => Some(s.redis.url.expose().to_string()),
            "clickhouse.password" => secret(&s.clickhouse.password),
            "clickhouse.url" => Some(s.clickhouse.url.expose().to_string()),
            "dedup.fingerprint_key" => Some(s.dedup.fingerprint_key.expose().to_string()),
            other => panic!("{other} is in SECRET_KEYS but not in this test"),
        }
    }

    #[test]
    fn every_secret_setting_reads_its_file_without_one_trailing_newline_and_never_prints_it() {
        for &key in SECRET_KEYS {
            let value = if key.ends_with("url") {
                if key.starts_with("redis") {
                    "redis://u:hunter2@cache:6379/"
                } else {
                    "https://u:hunter2@ch:8443/"
                }
            } else {
                "hunter2 with spaces "
            };
            let s = load(&[], &[(&var_name(key), &format!("{value}\n"))]).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(exposed(&s, key).as_deref(), Some(value), "{key}");
            let printed = format!("{s:?}\n{}", s.to_redacted_toml());
            assert!(!printed.contains("hunter2"), "{key}: {printed}");
        }
        // One newline only, CRLF counted as one; no newline at all is fine too.
        let s = load(&[], &[("CLICKAGG__REDIS__PASSWORD", "pw\n\n")]).unwrap();
        assert_eq!(s.redis.password.unwrap().expose(), "pw\n");
        let s = load(&[], &[("CLICKAGG__REDIS__PASSWORD", "pw\r\n")]).unwrap();
        assert_eq!(s.redis.password.unwrap().expose(), "pw");
        let s = load(&[], &[("CLICKAGG__REDIS__PASSWORD", "12345")]).unwrap();
        assert_eq!(s.redis.password.unwrap().expose(), "12345", "text, not a number");
    }

    #[test]
    fn a_variable_and_its_file_variable_together_are_refused_naming_both() {
        let e = load(&[("CLICKAGG__CLICKHOUSE__PASSWORD", "hunter2")], &[("CLICKAGG__CLICKHOUSE__PASSWORD", "other")])
            .unwrap_err();
        assert!(
            e.contains("CLICKAGG__CLICKHOUSE__PASSWORD and CLICKAGG__CLICKHOUSE__PASSWORD_FILE are both set"),
            "{e}"
        );
        assert!(!e.contains("hunter2") && !e.contains("other"), "{e}");
    }

    #[test]
    fn an_unreadable_file_is_refused_naming_the_variable_and_the_path_never_the_content() {
        let e = load(&[("CLICKAGG__REDIS__PASSWORD_FILE", "/nonexistent/redis-password")], &[]).unwrap_err();
        assert!(e.contains("CLICKAGG__REDIS__PASSWORD_FILE names /nonexistent/redis-password"), "{e}");
        assert!(e.contains("No such file"), "{e}");
        // Not UTF-8: refused without quoting a byte of it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, b"hunter2\xff\xfe").unwrap();
        let vars = [("CLICKAGG__DEDUP__FINGERPRINT_KEY_FILE", path.to_str().unwrap())];
        let e = Settings::load_with_vars(None, vec![], vars).unwrap_err().to_string();
        assert!(e.contains("CLICKAGG__DEDUP__FINGERPRINT_KEY_FILE") && e.contains(path.to_str().unwrap()), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        // A directory is no file either.
        let e = load(&[("CLICKAGG__KAFKA__SASL_PASSWORD_FILE", dir.path().to_str().unwrap())], &[]).unwrap_err();
        assert!(e.contains("CLICKAGG__KAFKA__SASL_PASSWORD_FILE names"), "{e}");
    }

    #[test]
    fn only_secret_settings_take_a_file_variable() {
        let e = load(&[], &[("CLICKAGG__KAFKA__TOPIC", "clicks")]).unwrap_err();
        assert!(e.contains("unknown key \"topic_file\""), "{e}");
    }

    #[test]
    fn the_file_wins_over_the_toml_file_and_loses_to_flags_like_the_environment() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[clickhouse]\npassword = \"from-toml\"\n[redis]\npassword = \"from-toml\"\n")?;
            jail.create_file("ch-password", "from-file\n")?;
            jail.create_file("redis-password", "from-file\n")?;
            jail.set_env("CLICKAGG__CLICKHOUSE__PASSWORD_FILE", "ch-password");
            jail.set_env("CLICKAGG__REDIS__PASSWORD_FILE", "redis-password");
            let flags = vec![("clickhouse.password", "from-flag".into())];
            let s = Settings::load(Some(Path::new("c.toml")), flags).unwrap();
            assert_eq!(s.clickhouse.password.unwrap().expose(), "from-flag");
            assert_eq!(s.redis.password.unwrap().expose(), "from-file");
            jail.set_env("CLICKAGG__REDIS__PASSWORD", "from-env");
            let e = Settings::load(None, vec![]).unwrap_err().to_string();
            assert!(e.contains("CLICKAGG__REDIS__PASSWORD and CLICKAGG__REDIS__PASSWORD_FILE are both set"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn a_url_from_a_file_is_validated_like_any_other() {
        let e = load(&[], &[("CLICKAGG__REDIS__URL", "http://u:hunter2@cache/\n")]).unwrap_err();
        assert!(e.contains("must start with redis://") && !e.contains("hunter2"), "{e}");
    }
}
