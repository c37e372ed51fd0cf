//! JSON records: one pass over the text that keeps only the values at the configured
//! paths (borrowed from the payload where no escape forces a copy) and skips the rest.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::fields::{Fields, Value};
use super::{RejectReason, Rejection};

/// The values at the three paths of `fields` (click ID, ad ID, event time), `None` where
/// the record has none. A syntax error is `malformed_json`; a value that is not an
/// object where a path goes through it, a top level that is not an object, or a field
/// given twice is `wrong_type`.
pub(super) fn extract<'a>(text: &'a str, fields: &Fields) -> Result<[Option<Value<'a>>; 3], Rejection> {
    let wanted: Vec<(&[String], usize)> =
        fields.named().iter().enumerate().map(|(i, (_, p))| (p.segments(), i)).collect();
    let mut out: [Option<Value<'a>>; 3] = [None, None, None];
    let mut de = serde_json::Deserializer::from_str(text);
    Level { wanted, out: &mut out, at: String::new() }.deserialize(&mut de).map_err(classify)?;
    de.end().map_err(classify)?;
    Ok(out)
}

fn classify(e: serde_json::Error) -> Rejection {
    use serde_json::error::Category;
    let reason = match e.classify() {
        Category::Data => RejectReason::WrongType,
        Category::Syntax | Category::Eof | Category::Io => RejectReason::MalformedJson,
    };
    Rejection::new(reason, e.to_string())
}

/// One object on the way to the wanted fields: the paths still to follow from here
/// (with the field each leads to), where the values go, and where this object is (for
/// messages).
struct Level<'p, 'o, 'a> {
    wanted: Vec<(&'p [String], usize)>,
    out: &'o mut [Option<Value<'a>>; 3],
    at: String,
}

impl<'de> DeserializeSeed<'de> for Level<'_, '_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Level<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.at.is_empty() {
            f.write_str("a JSON object")
        } else {
            write!(f, "an object at `{}`", self.at)
        }
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let Level { wanted, out, at } = self;
        // Keys of this object that lead to a wanted field, to refuse one given twice.
        let mut seen: Vec<Cow<'de, str>> = Vec::new();
        while let Some(Text(key)) = map.next_key::<Text<'de>>()? {
            let here: Vec<(&[String], usize)> =
                wanted.iter().filter(|(path, _)| path[0] == *key).map(|&(path, i)| (&path[1..], i)).collect();
            if here.is_empty() {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let inner = if at.is_empty() { key.to_string() } else { format!("{at}.{key}") };
            if seen.contains(&key) {
                return Err(de::Error::custom(format_args!("duplicate field `{inner}`")));
            }
            seen.push(key);
            match here.as_slice() {
                // Paths never overlap (`Fields::conflict`), so a leaf is alone here.
                [([], i)] => out[*i] = Some(map.next_value_seed(Leaf)?),
                _ => map.next_value_seed(Level { wanted: here, out: &mut *out, at: inner })?,
            }
        }
        Ok(())
    }

    // An array is read to its end first, so that a syntax error in it is reported as one.
    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<(), S::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Err(de::Error::invalid_type(de::Unexpected::Seq, &self))
    }
}

/// A key or string, borrowed from the text unless it holds an escape.
struct Text<'a>(Cow<'a, str>);

impl<'de> de::Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_str(V)
    }
}

/// A wanted field's value, of whatever JSON type.
struct Leaf;

impl<'de> DeserializeSeed<'de> for Leaf {
    type Value = Value<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Leaf {
    type Value = Value<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Value<'de>, E> {
        Ok(Value::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value<'de>, E> {
        Ok(Value::Str(Cow::Owned(v.to_string())))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value<'de>, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value<'de>, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Value<'de>, E> {
        Ok(Value::Other("a number with a fraction or exponent"))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Value<'de>, E> {
        Ok(Value::Other("a boolean"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value<'de>, E> {
        Ok(Value::Other("null"))
    }
    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Value<'de>, S::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Value::Other("an array"))
    }
    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Value<'de>, M::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Value::Other("an object"))
    }
}
