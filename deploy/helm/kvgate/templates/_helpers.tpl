{{/*
Names, labels and small shared pieces. Engine-specific pieces (the engine's merged values, its pod spec) are in
_engine.tpl.
*/}}

{{/* The chart's name: "kvgate" unless nameOverride. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's base name, shortened so that every name built on it (engine names, "-gateway", a LeaderWorkerSet's
"-lws" and the pod names LWS derives from it) stays within Kubernetes' 63-character limits.
*/}}
{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 30 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end -}}

{{/* The labels that select this release's objects (the ServiceMonitor selects Services by these). */}}
{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* ---- gateway ---------------------------------------------------------------------------------------------- */}}

{{- define "kvgate.gateway.fullname" -}}
{{- printf "%s-gateway" (include "kvgate.fullname" .) -}}
{{- end -}}

{{- define "kvgate.gateway.selectorLabels" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "kvgate.gateway.labels" -}}
{{ include "kvgate.labels" . }}
app.kubernetes.io/component: gateway
{{- end -}}

{{/* ---- shared ----------------------------------------------------------------------------------------------- */}}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the API key ("" when there is none). */}}
{{- define "kvgate.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "kvgate.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
An image reference: the component's own repository/tag when set, else the chart-wide ones.
Called with (dict "root" $ "image" <component image map> "gpu" <bool>): GPU engines default to image.gpuTag.
*/}}
{{- define "kvgate.image" -}}
{{- $img := .image | default dict -}}
{{- $defaultTag := ternary .root.Values.image.gpuTag .root.Values.image.tag (.gpu | default false) -}}
{{- printf "%s:%s" ($img.repository | default .root.Values.image.repository) (toString ($img.tag | default $defaultTag)) -}}
{{- end -}}

{{- define "kvgate.imagePullPolicy" -}}
{{- $img := .image | default dict -}}
{{- $img.pullPolicy | default .root.Values.image.pullPolicy -}}
{{- end -}}

{{/*
A command-line argument as a string. Helm reads numbers from values files as floats, so that 1073741824 would
print as 1.073741824e+09: whole numbers are printed as integers.
*/}}
{{- define "kvgate.arg" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/*
Merges the map .src into the map .dst, in place: keys of .src win (false, 0 and "" included, unlike sprig's
merge); maps present on both sides are merged key by key, lists and other values are replaced.
*/}}
{{- define "kvgate.deepMerge" -}}
{{- $dst := .dst -}}
{{- range $k, $v := .src -}}
{{- if and (kindIs "map" $v) (kindIs "map" (index $dst $k)) -}}
{{- include "kvgate.deepMerge" (dict "dst" (index $dst $k) "src" $v) -}}
{{- else -}}
{{- $_ := set $dst $k $v -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
preStop hook: wait before kvgate gets SIGTERM, so that the endpoint is gone from every Service before kvgate stops
accepting connections. Uses the sleep action (Kubernetes >= 1.30), left out on older clusters or when seconds is 0.
Called with (dict "root" $ "seconds" N).
*/}}
{{- define "kvgate.lifecycle" -}}
{{- if and (gt (int .seconds) 0) (semverCompare ">=1.30-0" .root.Capabilities.KubeVersion.Version) }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ int .seconds }}
{{- end }}
{{- end -}}

{{/*
A probe from values ({path, periodSeconds, timeoutSeconds, failureThreshold, successThreshold,
initialDelaySeconds}) as an httpGet probe on the port named http.
*/}}
{{- define "kvgate.probe" -}}
httpGet:
  path: {{ .path }}
  port: http
{{- range $k := list "initialDelaySeconds" "periodSeconds" "timeoutSeconds" "successThreshold" "failureThreshold" }}
{{- if hasKey $ $k }}
{{ $k }}: {{ int (index $ $k) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Prometheus annotations on pods that serve /metrics (annotation-based scraping). */}}
{{- define "kvgate.metricsAnnotations" -}}
{{- if .Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: "8000"
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/*
Checks that a terminationGracePeriodSeconds leaves kvgate its --shutdown-timeout after the preStop sleep.
Called with (dict "what" "gateway" "grace" N "shutdown" N "preStop" N).
*/}}
{{- define "kvgate.checkGrace" -}}
{{- if le (float64 .grace) (addf .shutdown .preStop) -}}
{{- fail (printf "%s: terminationGracePeriodSeconds (%v) must be above shutdownTimeout (%v) + preStopSleepSeconds (%v), or Kubernetes kills kvgate before its requests have drained" .what .grace .shutdown .preStop) -}}
{{- end -}}
{{- end -}}
