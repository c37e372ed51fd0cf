{{/* Names and labels. */}}
{{- define "clickagg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "clickagg.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "clickagg.instanceLabels" -}}
app.kubernetes.io/name: {{ include "clickagg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The members' pods, and only those (not the hook Jobs' pods). */}}
{{- define "clickagg.selectorLabels" -}}
{{ include "clickagg.instanceLabels" . }}
app.kubernetes.io/component: member
{{- end }}

{{- define "clickagg.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "clickagg.instanceLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "clickagg.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "clickagg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "clickagg.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Secrets: the key of each secret setting in the Secret (= its file name under
/var/run/secrets/clickagg/) and the variable that names the file to clickagg. clickagg
reads `<VAR>_FILE` for every secret variable `<VAR>`. Keep this list, values.yaml and
README.md ("Deploying on Kubernetes") in step.
*/}}
{{- define "clickagg.secretFileVars" -}}
kafka-sasl-password: CLICKAGG__KAFKA__SASL_PASSWORD_FILE
kafka-ssl-key-password: CLICKAGG__KAFKA__SSL_KEY_PASSWORD_FILE
kafka-oauth-client-secret: CLICKAGG__KAFKA__OAUTH_CLIENT_SECRET_FILE
redis-password: CLICKAGG__REDIS__PASSWORD_FILE
redis-url: CLICKAGG__REDIS__URL_FILE
clickhouse-password: CLICKAGG__CLICKHOUSE__PASSWORD_FILE
clickhouse-url: CLICKAGG__CLICKHOUSE__URL_FILE
dedup-fingerprint-key: CLICKAGG__DEDUP__FINGERPRINT_KEY_FILE
{{- end }}

{{- define "clickagg.secretMountPath" -}}/var/run/secrets/clickagg{{- end }}

{{/* The Secret's name, or "" when no secret setting is given. */}}
{{- define "clickagg.secretName" -}}
{{- if .Values.secret.existingSecret }}
{{- .Values.secret.existingSecret }}
{{- else if .Values.secret.values }}
{{- include "clickagg.fullname" . }}
{{- end }}
{{- end }}

{{/* The keys the Secret holds, sorted, one per line. */}}
{{- define "clickagg.secretKeys" -}}
{{- if .Values.secret.existingSecret }}
{{- range (sortAlpha .Values.secret.keys) }}
{{ . }}
{{- end }}
{{- else }}
{{- range $k, $_ := .Values.secret.values }}
{{ $k }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Refuses values the chart cannot deploy correctly, saying what to change. Included
by the templates that depend on them, so `helm install` fails before anything is
created.
*/}}
{{- define "clickagg.validate" -}}
{{- $c := .Values.config }}
{{- if not (kindIs "map" $c) }}
{{- fail "config must be a map of sections (kafka, redis, clickhouse, ...)" }}
{{- end }}
{{- range $section, $table := $c }}
{{- if not (regexMatch "^[a-z_]+$" $section) }}
{{- fail (printf "config.%s: not a clickagg section (clickagg config lists them)" $section) }}
{{- end }}
{{- if not (kindIs "map" $table) }}
{{- fail (printf "config.%s must be a map of settings" $section) }}
{{- end }}
{{- end }}
{{- if hasKey (default dict $c.kafka) "group_instance_id" }}
{{- fail "config.kafka.group_instance_id: the chart sets it to each pod's name (static membership); remove it" }}
{{- end }}
{{- if hasKey (default dict $c.pipeline) "drain_timeout" }}
{{- fail "config.pipeline.drain_timeout: set drainTimeoutSeconds instead (it also sets terminationGracePeriodSeconds)" }}
{{- end }}
{{- $secretSettings := dict "kafka" (list "sasl_password" "ssl_key_password") "redis" (list "password") "clickhouse" (list "password") "dedup" (list "fingerprint_key") }}
{{- range $section, $keys := $secretSettings }}
{{- range $keys }}
{{- if hasKey (default dict (get $c $section)) . }}
{{- fail (printf "config.%s.%s is a secret: put it in the Secret (secret.values or secret.existingSecret, key %s-%s), not in the ConfigMap" $section . $section (replace "_" "-" .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq (toString (dig "http" "enabled" true $c)) "false" }}
{{- fail "config.http.enabled = false: the probes and metrics need the HTTP server" }}
{{- end }}
{{- $addr := toString (dig "http" "addr" "" $c) }}
{{- if not (regexMatch "^(0\\.0\\.0\\.0|\\[::\\]):[0-9]+$" $addr) }}
{{- fail (printf "config.http.addr = %q: give 0.0.0.0:PORT (or [::]:PORT) so the kubelet and Prometheus reach it" $addr) }}
{{- end }}
{{- if not (and (kindIs "float64" .Values.drainTimeoutSeconds) (gt (float64 .Values.drainTimeoutSeconds) 0.0)) }}
{{- if not (and (kindIs "int64" .Values.drainTimeoutSeconds) (gt (int64 .Values.drainTimeoutSeconds) 0)) }}
{{- fail "drainTimeoutSeconds must be a positive number of seconds" }}
{{- end }}
{{- end }}
{{- if lt (int .Values.terminationGraceMarginSeconds) 5 }}
{{- fail "terminationGraceMarginSeconds must be at least 5: the process still closes its Kafka client after the drain deadline" }}
{{- end }}
{{- $known := fromYaml (include "clickagg.secretFileVars" .) }}
{{- if and .Values.secret.existingSecret .Values.secret.values }}
{{- fail "secret: give existingSecret (with keys) or values, not both" }}
{{- end }}
{{- if and .Values.secret.keys (not .Values.secret.existingSecret) }}
{{- fail "secret.keys lists the keys of secret.existingSecret: set existingSecret too, or give secret.values" }}
{{- end }}
{{- range (splitList "\n" (include "clickagg.secretKeys" . | trim)) }}
{{- if and . (not (hasKey $known .)) }}
{{- fail (printf "secret key %q is not a clickagg secret; known keys: %s" . (keys $known | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The port of config.http.addr. */}}
{{- define "clickagg.httpPort" -}}
{{- regexFind "[0-9]+$" (toString (dig "http" "addr" "" .Values.config)) }}
{{- end }}

{{/*
The configuration file: config as TOML, with pipeline.drain_timeout from
drainTimeoutSeconds. Sections become tables, maps inside a section (kafka.properties)
sub-tables with quoted keys; strings are JSON-quoted (a valid TOML basic string) and
whole numbers are written as integers (Helm reads every YAML number as a float).
*/}}
{{- define "clickagg.toml" -}}
{{- $config := deepCopy .Values.config }}
{{- $pipeline := default dict (get $config "pipeline") }}
{{- $_ := set $pipeline "drain_timeout" (printf "%ds" (int .Values.drainTimeoutSeconds)) }}
{{- $_ := set $config "pipeline" $pipeline }}
{{- range $section, $table := $config }}
[{{ $section }}]
{{- $nested := dict }}
{{- range $key, $value := $table }}
{{- if kindIs "map" $value }}
{{- $_ := set $nested $key $value }}
{{- else if not (kindIs "invalid" $value) }}
{{ $key }} = {{ include "clickagg.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $key, $sub := $nested }}
[{{ $section }}.{{ $key }}]
{{- range $k, $v := $sub }}
{{ toJson $k }} = {{ include "clickagg.tomlValue" $v }}
{{- end }}
{{- end }}
{{ end }}
{{- end }}

{{- define "clickagg.tomlValue" -}}
{{- if kindIs "string" . }}{{ toJson . }}
{{- else if kindIs "bool" . }}{{ . }}
{{- else if kindIs "float64" . }}{{ if eq (float64 (int64 .)) . }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if or (kindIs "int" .) (kindIs "int64" .) }}{{ . }}
{{- else if kindIs "slice" . }}[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "clickagg.tomlValue" $v }}{{ end }}]
{{- else }}{{ fail (printf "config: cannot write %v (%s) as TOML" . (kindOf .)) }}
{{- end }}
{{- end }}

{{/*
What a member and the hook Jobs share: the configuration file, the secret files and
the variables that point clickagg at them. `root` is the chart context, `configMap`
the ConfigMap to mount.
*/}}
{{- define "clickagg.configEnv" -}}
{{- $root := .root }}
{{- $known := fromYaml (include "clickagg.secretFileVars" $root) }}
{{- range (splitList "\n" (include "clickagg.secretKeys" $root | trim)) }}
{{- if . }}
- name: {{ get $known . }}
  value: {{ printf "%s/%s" (include "clickagg.secretMountPath" $root) . | quote }}
{{- end }}
{{- end }}
# The image sets CLICKAGG__HTTP__ADDR, which would win over the configuration file.
- name: CLICKAGG__HTTP__ADDR
  value: {{ $root.Values.config.http.addr | quote }}
{{- end }}

{{- define "clickagg.configMounts" -}}
{{- $root := .root }}
- name: config
  mountPath: /etc/clickagg/config
  readOnly: true
{{- if include "clickagg.secretName" $root }}
- name: secrets
  mountPath: {{ include "clickagg.secretMountPath" $root }}
  readOnly: true
{{- end }}
{{- if $root.Values.tls.existingSecret }}
- name: tls
  mountPath: {{ $root.Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "clickagg.configVolumes" -}}
{{- $root := .root }}
- name: config
  configMap:
    name: {{ .configMap }}
{{- with (include "clickagg.secretName" $root) }}
- name: secrets
  secret:
    secretName: {{ $.secret | default . }}
    # 0440: the group (fsGroup, the image's user) reads them, nobody writes.
    defaultMode: 288
    items:
{{- range (splitList "\n" (include "clickagg.secretKeys" $root | trim)) }}
      - key: {{ . }}
        path: {{ . }}
{{- end }}
{{- end }}
{{- if $root.Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ $root.Values.tls.existingSecret }}
    defaultMode: 288
{{- end }}
{{- end }}

{{- define "clickagg.configFile" -}}/etc/clickagg/config/clickagg.toml{{- end }}

{{/* Pod security and scheduling shared by the members and the hook Jobs. */}}
{{- define "clickagg.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}
