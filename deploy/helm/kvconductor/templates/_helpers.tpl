{{/* Names and labels. */}}
{{- define "kvconductor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvconductor.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A component's name: "<fullname>-<component>", 52 characters at most so
that a StatefulSet's pods (and their controller-revision-hash label) stay
within Kubernetes' limits. */}}
{{- define "kvconductor.componentName" -}}
{{- printf "%s-%s" (include "kvconductor.fullname" .root | trunc 40 | trimSuffix "-") .component | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvconductor.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvconductor
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component; call with (dict "root" $ "component" "daemon"). */}}
{{- define "kvconductor.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvconductor.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvconductor.componentLabels" -}}
{{ include "kvconductor.labels" .root }}
{{ include "kvconductor.selectorLabels" . }}
{{- end -}}

{{- define "kvconductor.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "kvconductor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvconductor.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* ------------------------------------------------------------ secrets */}}

{{/* The Secret the chart writes (bearer token, SASL password), if any. */}}
{{- define "kvconductor.secretName" -}}
{{- include "kvconductor.componentName" (dict "root" . "component" "secrets") -}}
{{- end -}}

{{- define "kvconductor.authSecretName" -}}
{{- .Values.auth.existingSecret | default (include "kvconductor.secretName" .) -}}
{{- end -}}

{{- define "kvconductor.authSecretKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretKey }}{{- else -}}http-token{{- end -}}
{{- end -}}

{{- define "kvconductor.saslEnabled" -}}
{{- if hasPrefix "SASL_" .Values.kafka.securityProtocol -}}true{{- end -}}
{{- end -}}

{{- define "kvconductor.tlsEnabled" -}}
{{- if has .Values.kafka.securityProtocol (list "SSL" "SASL_SSL") -}}true{{- end -}}
{{- end -}}

{{- define "kvconductor.saslSecretName" -}}
{{- .Values.kafka.sasl.existingSecret | default (include "kvconductor.secretName" .) -}}
{{- end -}}

{{- define "kvconductor.saslSecretKey" -}}
{{- if .Values.kafka.sasl.existingSecret -}}{{ .Values.kafka.sasl.existingSecretKey }}{{- else -}}kafka-sasl-password{{- end -}}
{{- end -}}

{{/* The bearer token: the value, else the one already in the cluster (kept
across upgrades), else a new random one. `helm template` sees no cluster and
renders a random one each time. */}}
{{- define "kvconductor.authToken" -}}
{{- if .Values.auth.token -}}
{{- .Values.auth.token -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "kvconductor.secretName" .) -}}
{{- if and $existing (index ($existing.data | default dict) "http-token") -}}
{{- index $existing.data "http-token" | b64dec -}}
{{- else -}}
{{- randAlphaNum 43 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Whether the chart writes a Secret of its own. */}}
{{- define "kvconductor.ownSecret" -}}
{{- if or (and .Values.auth.enabled (not .Values.auth.existingSecret)) (and (include "kvconductor.saslEnabled" .) (not .Values.kafka.sasl.existingSecret)) -}}true{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------- paths in the pods */}}
{{- define "kvconductor.configDir" -}}/etc/kvconductor/k8s{{- end -}}
{{- define "kvconductor.tokenFile" -}}/run/secrets/kvconductor/http/token{{- end -}}
{{- define "kvconductor.saslFile" -}}/run/secrets/kvconductor/kafka-sasl/password{{- end -}}
{{- define "kvconductor.caDir" -}}/run/secrets/kvconductor/kafka-ca{{- end -}}
{{- define "kvconductor.clientTlsDir" -}}/run/secrets/kvconductor/kafka-client-tls{{- end -}}

{{/* ------------------------------------------------------ configuration */}}

{{/* One TOML value. Helm reads YAML numbers as floats: whole numbers are
written as TOML integers (the loader takes an integer for a float key, never
a float for an integer key). */}}
{{- define "kvconductor.tomlValue" -}}
{{- if kindIs "string" . -}}
{{- toJson . -}}
{{- else if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) -}}
{{- if eq (float64 .) (float64 (int64 .)) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if or (kindIs "int" .) (kindIs "int64" .) (kindIs "uint64" .) -}}
{{- . -}}
{{- else -}}
{{- fail (printf "kvconductor: a configuration value must be a string, number or boolean, got %v" .) -}}
{{- end -}}
{{- end -}}

{{/* A TOML table: (dict "name" "kafka" "table" $map [ "array" true ]). */}}
{{- define "kvconductor.tomlTable" -}}
{{ if .array }}[[{{ .name }}]]{{ else }}[{{ .name }}]{{ end }}
{{- range $key, $value := .table }}
{{- if not (kindIs "invalid" $value) }}
{{ $key }} = {{ include "kvconductor.tomlValue" $value }}
{{- end }}
{{- end }}
{{ end -}}

{{/* The [kafka] table every process reads: the user's `config.kafka`, then
what the chart decides (brokers, security, mounted secret files). */}}
{{- define "kvconductor.kafkaTable" -}}
{{- $k := deepCopy (.Values.config.kafka | default dict) -}}
{{- $_ := set $k "bootstrap_servers" .Values.kafka.bootstrapServers -}}
{{- $_ := set $k "security_protocol" .Values.kafka.securityProtocol -}}
{{- if include "kvconductor.saslEnabled" . -}}
{{- $_ := set $k "sasl_mechanism" .Values.kafka.sasl.mechanism -}}
{{- $_ := set $k "sasl_username" .Values.kafka.sasl.username -}}
{{- $_ := set $k "sasl_password_file" (include "kvconductor.saslFile" .) -}}
{{- end -}}
{{- if include "kvconductor.tlsEnabled" . -}}
{{- if .Values.kafka.tls.caSecret -}}
{{- $_ := set $k "ssl_cafile" (printf "%s/%s" (include "kvconductor.caDir" .) .Values.kafka.tls.caKey) -}}
{{- end -}}
{{- if .Values.kafka.tls.clientSecret -}}
{{- $_ := set $k "ssl_certfile" (printf "%s/%s" (include "kvconductor.clientTlsDir" .) .Values.kafka.tls.certKey) -}}
{{- $_ := set $k "ssl_keyfile" (printf "%s/%s" (include "kvconductor.clientTlsDir" .) .Values.kafka.tls.keyKey) -}}
{{- end -}}
{{- end -}}
{{- toJson $k -}}
{{- end -}}

{{/* The daemon's and the replicas' file (config/kvconductor.toml's keys). */}}
{{- define "kvconductor.daemonToml" -}}
{{- $http := deepCopy (.Values.config.http | default dict) -}}
{{- $_ := set $http "host" "0.0.0.0" -}}
{{- $_ := set $http "port" (int .Values.service.port) -}}
{{- if .Values.auth.enabled -}}
{{- $_ := set $http "auth_token_file" (include "kvconductor.tokenFile" .) -}}
{{- $_ := set $http "allow_unauthenticated" false -}}
{{- else -}}
{{- $_ := set $http "allow_unauthenticated" true -}}
{{- end -}}
# kvconductor's configuration, written by the Helm chart from its values
# (`config.*`); the pods add KVCONDUCTOR_KAFKA_CLIENT_ID and
# KVCONDUCTOR_KAFKA_GROUP_INSTANCE_ID. Reference: docs/configuration.md.
{{ include "kvconductor.tomlTable" (dict "name" "kafka" "table" (include "kvconductor.kafkaTable" . | fromJson)) }}
{{ include "kvconductor.tomlTable" (dict "name" "http" "table" $http) }}
{{- range $section := list "index" "snapshot" "log" }}
{{- with index $.Values.config $section }}
{{ include "kvconductor.tomlTable" (dict "name" $section "table" .) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The bridge's file (config/bridge.toml's keys). */}}
{{- define "kvconductor.bridgeToml" -}}
{{- $b := deepCopy (.Values.bridge.config | default dict) -}}
{{- $_ := set $b "host" "0.0.0.0" -}}
{{- $_ := set $b "port" (int .Values.bridge.service.port) -}}
{{- $_ := set $b "registrations_topic" (.Values.config.http.registrations_topic | default "kv-bridge-registrations") -}}
{{- if .Values.auth.enabled -}}
{{- $_ := set $b "auth_token_file" (include "kvconductor.tokenFile" .) -}}
{{- $_ := set $b "allow_unauthenticated" false -}}
{{- else -}}
{{- $_ := set $b "allow_unauthenticated" true -}}
{{- end -}}
# kvconductor bridge's configuration, written by the Helm chart from its
# values (`config.kafka`, `bridge.config`, `bridge.publishers`).
# Reference: docs/bridge.md.
{{ include "kvconductor.tomlTable" (dict "name" "kafka" "table" (include "kvconductor.kafkaTable" . | fromJson)) }}
{{ include "kvconductor.tomlTable" (dict "name" "bridge" "table" $b) }}
{{- with .Values.config.log }}
{{ include "kvconductor.tomlTable" (dict "name" "log" "table" .) }}
{{- end }}
{{- range .Values.bridge.publishers }}
{{ include "kvconductor.tomlTable" (dict "name" "publishers" "table" . "array" true) }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------- pod building blocks */}}

{{/* Volumes holding the configuration and the secrets a Kafka client and the
HTTP API need. (dict "root" $ "configMap" NAME) */}}
{{- define "kvconductor.volumes" -}}
{{- $root := .root -}}
- name: config
  configMap:
    name: {{ .configMap }}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if $root.Values.auth.enabled }}
- name: http-token
  secret:
    secretName: {{ .authSecret | default (include "kvconductor.authSecretName" $root) }}
    defaultMode: 0440
    items:
      - key: {{ include "kvconductor.authSecretKey" $root }}
        path: token
{{- end }}
{{- if include "kvconductor.saslEnabled" $root }}
- name: kafka-sasl
  secret:
    secretName: {{ .saslSecret | default (include "kvconductor.saslSecretName" $root) }}
    defaultMode: 0440
    items:
      - key: {{ include "kvconductor.saslSecretKey" $root }}
        path: password
{{- end }}
{{- if and (include "kvconductor.tlsEnabled" $root) $root.Values.kafka.tls.caSecret }}
- name: kafka-ca
  secret:
    secretName: {{ $root.Values.kafka.tls.caSecret }}
    defaultMode: 0440
    items:
      - key: {{ $root.Values.kafka.tls.caKey }}
        path: {{ $root.Values.kafka.tls.caKey }}
{{- end }}
{{- if and (include "kvconductor.tlsEnabled" $root) $root.Values.kafka.tls.clientSecret }}
- name: kafka-client-tls
  secret:
    secretName: {{ $root.Values.kafka.tls.clientSecret }}
    defaultMode: 0440
    items:
      - key: {{ $root.Values.kafka.tls.certKey }}
        path: {{ $root.Values.kafka.tls.certKey }}
      - key: {{ $root.Values.kafka.tls.keyKey }}
        path: {{ $root.Values.kafka.tls.keyKey }}
{{- end }}
{{- end -}}

{{- define "kvconductor.volumeMounts" -}}
- name: config
  mountPath: {{ include "kvconductor.configDir" . }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.auth.enabled }}
- name: http-token
  mountPath: {{ include "kvconductor.tokenFile" . | dir }}
  readOnly: true
{{- end }}
{{- if include "kvconductor.saslEnabled" . }}
- name: kafka-sasl
  mountPath: {{ include "kvconductor.saslFile" . | dir }}
  readOnly: true
{{- end }}
{{- if and (include "kvconductor.tlsEnabled" .) .Values.kafka.tls.caSecret }}
- name: kafka-ca
  mountPath: {{ include "kvconductor.caDir" . }}
  readOnly: true
{{- end }}
{{- if and (include "kvconductor.tlsEnabled" .) .Values.kafka.tls.clientSecret }}
- name: kafka-client-tls
  mountPath: {{ include "kvconductor.clientTlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvconductor.podSecurityContext" -}}
runAsNonRoot: true
# The image's `kvconductor` user.
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvconductor.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Checksums of what the pods read at start, so that a changed value rolls them. */}}
{{- define "kvconductor.configChecksum" -}}
{{- printf "%s\n%s" (include "kvconductor.daemonToml" .) (include "kvconductor.bridgeToml" .) | sha256sum -}}
{{- end -}}

{{/* ------------------------------------------------------------- topics */}}

{{/* The topics kvconductor reads and writes, as the daemon's
kvconductor.kafka.topics.topic_specs lists them (deploy/check compares the
two): a JSON list of {name, partitions, compacted}. */}}
{{- define "kvconductor.topicList" -}}
{{- $k := .Values.config.kafka -}}
{{- $p := int ($k.partitions | default 6) -}}
{{- $topics := list -}}
{{- if $k.repartition -}}
{{- $topics = append $topics (dict "name" ($k.repartition_topic | default "kv-index-input") "partitions" $p "compacted" false) -}}
{{- end -}}
{{- $reg := .Values.config.http.registrations_topic -}}
{{- if kindIs "invalid" $reg }}{{ $reg = "kv-bridge-registrations" }}{{ end -}}
{{- if $reg -}}
{{- $topics = append $topics (dict "name" $reg "partitions" $p "compacted" true) -}}
{{- end -}}
{{- $topics = append $topics (dict "name" ($k.engine_topic | default "kv-events") "partitions" $p "compacted" false) -}}
{{- $topics = append $topics (dict "name" ($k.pool_topic | default "kv-pool-events") "partitions" $p "compacted" false) -}}
{{- $topics = append $topics (dict "name" ($k.dead_letter_topic | default "kv-dead-letters") "partitions" 1 "compacted" false) -}}
{{- $topics = append $topics (dict "name" ($k.snapshot_topic | default "kv-index-snapshots") "partitions" 1 "compacted" true) -}}
{{- toJson $topics -}}
{{- end -}}

{{/* The image's ENV sets KVCONDUCTOR_LOG_FORMAT=json (and the HTTP host),
which would win over the file: the chart's value is passed the same way. */}}
{{- define "kvconductor.imageEnvOverrides" -}}
- name: KVCONDUCTOR_LOG_FORMAT
  value: {{ (.Values.config.log | default dict).format | default "json" | quote }}
{{- end -}}
