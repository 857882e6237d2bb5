{{- define "marsproxy.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "marsproxy.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end -}}

{{- define "marsproxy.labels" -}}
{{ include "marsproxy.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "marsproxy.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if .Values.redis.sentinel.hosts -}}
{{- ternary "rediss://" "redis://" .Values.redis.tls.enabled -}}sentinel/0
{{- else -}}
{{- printf "redis://%s-redis:6379/0" (include "marsproxy.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "marsproxy.useRedis" -}}
{{- if and (eq .Values.mode "gateway") (or .Values.redis.url .Values.redis.sentinel.hosts .Values.redis.enabled) -}}true{{- end -}}
{{- end -}}

{{/* Deploy the chart's own Redis: gateway mode, enabled, and neither a url nor sentinels. */}}
{{- define "marsproxy.ownRedis" -}}
{{- if and (include "marsproxy.useRedis" .) (not .Values.redis.url) (not .Values.redis.sentinel.hosts) -}}true{{- end -}}
{{- end -}}

{{/* The marsproxy config file: what the mode needs, with .Values.config merged over it. */}}
{{- define "marsproxy.config" -}}
{{- if not (has .Values.mode (list "sidecar" "gateway")) -}}
{{- fail (printf "mode must be sidecar or gateway, not %q" .Values.mode) -}}
{{- end -}}
{{- $workers := list -}}
{{- if eq .Values.mode "sidecar" -}}
{{- $workers = list (dict "url" "http://127.0.0.1:8000" "name" "local") -}}
{{- else -}}
{{- if not .Values.workers -}}
{{- fail "gateway mode needs .Values.workers (the vLLM URLs, [{url: ..., name: ...}])" -}}
{{- end -}}
{{- $workers = .Values.workers -}}
{{- end -}}
{{- $store := dict "backend" "memory" -}}
{{- if include "marsproxy.useRedis" . -}}
{{- $store = dict "backend" "redis" "redis_url" (include "marsproxy.redisUrl" .) "pool" (include "marsproxy.fullname" .) -}}
{{- with .Values.redis.sentinel.hosts -}}
{{- $_ := set $store "sentinels" . -}}
{{- $_ := set $store "sentinel_service" $.Values.redis.sentinel.service -}}
{{- end -}}
{{- with .Values.redis.username -}}
{{- $_ := set $store "username" . -}}
{{- end -}}
{{- if .Values.redis.existingSecret -}}
{{- $_ := set $store "password_env" "REDIS_PASSWORD" -}}
{{- if .Values.redis.sentinelPasswordKey -}}
{{- $_ := set $store "sentinel_password_env" "REDIS_SENTINEL_PASSWORD" -}}
{{- end -}}
{{- end -}}
{{- if .Values.redis.tls.enabled -}}
{{- if not .Values.redis.tls.existingSecret -}}
{{- fail "redis.tls.enabled needs redis.tls.existingSecret (a Secret with ca.crt)" -}}
{{- end -}}
{{- $tls := dict "ca_file" "/etc/redis-tls/ca.crt" -}}
{{- if .Values.redis.tls.clientCertificate -}}
{{- $_ := set $tls "cert_file" "/etc/redis-tls/tls.crt" -}}
{{- $_ := set $tls "key_file" "/etc/redis-tls/tls.key" -}}
{{- end -}}
{{- $_ := set $store "tls" $tls -}}
{{- end -}}
{{- end -}}
{{- $cfg := dict "policy" .Values.policy "server" (dict "host" "0.0.0.0" "port" 8080) "workers" $workers "store" $store "probes" (dict "nvml" (dict "enabled" false)) -}}
{{- toYaml (mustMergeOverwrite $cfg (deepCopy .Values.config)) -}}
{{- end -}}


{{/* The Secret and key of the admin token, "" when none is configured. */}}
{{- define "marsproxy.authSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else if .Values.auth.adminToken -}}
{{- printf "%s-auth" (include "marsproxy.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "marsproxy.authSecretKey" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecretKey -}}
{{- else -}}
admin-token
{{- end -}}
{{- end -}}
