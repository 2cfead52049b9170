{{/*
Engines: each entry of .Values.engines is merged over .Values.engineDefaults (kvgate.engine.values), then every
template builds its objects from the merged map. Usage in a template:

  {{- range $entry := .Values.engines }}
  {{- $e := dict }}
  {{- include "kvgate.engine.values" (dict "root" $ "engine" $entry "out" $e) }}
  ...
*/}}

{{/* Flags the chart sets itself: they may not appear in an engine's args or serveArgs. */}}
{{- define "kvgate.engine.chartFlags" -}}
model|served-model-name|host|port|config|tensor-parallel-size|pipeline-parallel-size|distributed-executor-backend|shutdown-timeout
{{- end -}}

{{/* Engine flags `kvgate worker` refuses (kvgate serve only): with multiNode they belong in serveArgs. */}}
{{- define "kvgate.engine.serveOnlyFlags" -}}
engine-core-process|no-engine-core-process|on-engine-core-death|max-engine-core-restarts|scheduler-delay|max-tokens-default|enable-auto-tool-choice|no-enable-auto-tool-choice|tool-call-parser|reasoning-parser
{{- end -}}

{{/* Fills .out with .engine merged over engineDefaults, and checks it (fail with the reason). */}}
{{- define "kvgate.engine.values" -}}
{{- $root := .root -}}
{{- $e := .out -}}
{{- include "kvgate.deepMerge" (dict "dst" $e "src" (deepCopy $root.Values.engineDefaults)) -}}
{{- include "kvgate.deepMerge" (dict "dst" $e "src" (deepCopy .engine)) -}}
{{- $name := toString ($e.name | default "") -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]{0,18}[a-z0-9])?$" $name) -}}
{{- fail (printf "engines: each engine needs a name of at most 20 characters (lowercase letters, digits, '-', starting with a letter), got %q" $name) -}}
{{- end -}}
{{- if eq $name "gateway" -}}
{{- fail "engines: the name \"gateway\" is taken by the gateway's objects" -}}
{{- end -}}
{{- $count := 0 -}}
{{- range $root.Values.engines -}}
{{- if eq (toString .name) $name -}}{{- $count = add1 $count -}}{{- end -}}
{{- end -}}
{{- if gt $count 1 -}}
{{- fail (printf "engines: the name %q is used by %d engines" $name $count) -}}
{{- end -}}
{{- $model := toString ($e.model | default "") -}}
{{- if or (hasPrefix "/" $model) (regexMatch "(^|/)\\.\\.(/|$)" $model) -}}
{{- fail (printf "engines[%s].model: a path under /models without a leading / or .., got %q" $name $model) -}}
{{- end -}}
{{- $tp := int $e.tensorParallelSize -}}
{{- $pp := int $e.pipelineParallelSize -}}
{{- $gpu := int $e.gpu -}}
{{- if or (lt $tp 1) (lt $pp 1) -}}
{{- fail (printf "engines[%s]: tensorParallelSize and pipelineParallelSize must be at least 1" $name) -}}
{{- end -}}
{{- if $e.multiNode.enabled -}}
{{- if lt (mul $tp $pp) 2 -}}
{{- fail (printf "engines[%s].multiNode: needs tensorParallelSize x pipelineParallelSize >= 2 (one rank per pod)" $name) -}}
{{- end -}}
{{- if gt $gpu 1 -}}
{{- fail (printf "engines[%s].multiNode: one rank per pod, so gpu must be 0 (CPU, gloo) or 1, got %d" $name $gpu) -}}
{{- end -}}
{{- else if and (gt $gpu 0) (lt $gpu (mul $tp $pp)) -}}
{{- fail (printf "engines[%s]: tensorParallelSize x pipelineParallelSize (%d) ranks need as many GPUs in the pod, gpu is %d (or set multiNode.enabled to spread them over pods)" $name (mul $tp $pp) $gpu) -}}
{{- end -}}
{{- $chartFlags := printf "^--(%s)(=.*)?$" (include "kvgate.engine.chartFlags" .) -}}
{{- $serveOnly := printf "^--(%s)(=.*)?$" (include "kvgate.engine.serveOnlyFlags" .) -}}
{{- range $a := concat ($e.args | default list) ($e.serveArgs | default list) -}}
{{- if regexMatch $chartFlags (toString $a) -}}
{{- fail (printf "engines[%s]: %s is set by the chart (use model, servedModelName, tensorParallelSize, pipelineParallelSize, multiNode or shutdownTimeout)" $name (toString $a)) -}}
{{- end -}}
{{- end -}}
{{- if $e.multiNode.enabled -}}
{{- range $a := ($e.args | default list) -}}
{{- if regexMatch $serveOnly (toString $a) -}}
{{- fail (printf "engines[%s].args: `kvgate worker` refuses %s; with multiNode put it in serveArgs (the leader's flags only)" $name (toString $a)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- include "kvgate.checkGrace" (dict "what" (printf "engines[%s]" $name) "grace" $e.terminationGracePeriodSeconds "shutdown" $e.shutdownTimeout "preStop" $e.preStopSleepSeconds) -}}
{{- end -}}

{{/* Name of an engine's objects (Deployment, Service, ...). Called with (dict "root" $ "e" $e). */}}
{{- define "kvgate.engine.fullname" -}}
{{- printf "%s-%s" (include "kvgate.fullname" .root) .e.name -}}
{{- end -}}

{{/*
Name of a multiNode engine's LeaderWorkerSet (not the engine's name: LWS creates a headless Service named after
it). At most 45 characters: LWS names a worker StatefulSet "<name>-<group>", and a StatefulSet's name must leave
room for its pods' controller-revision-hash label (63 characters).
*/}}
{{- define "kvgate.engine.lwsName" -}}
{{- printf "%s-lws" (include "kvgate.engine.fullname" . | trunc 41 | trimSuffix "-") -}}
{{- end -}}

{{/* The model id the engine serves and the gateway routes by. */}}
{{- define "kvgate.engine.servedModelName" -}}
{{- if .servedModelName -}}
{{- .servedModelName -}}
{{- else if .model -}}
{{- base (toString .model) | trimSuffix ".gguf" -}}
{{- else -}}
SmolLM2-135M-Instruct
{{- end -}}
{{- end -}}

{{- define "kvgate.engine.selectorLabels" -}}
{{ include "kvgate.selectorLabels" .root }}
app.kubernetes.io/component: engine
kvgate.io/engine: {{ .e.name }}
{{- end -}}

{{- define "kvgate.engine.labels" -}}
{{ include "kvgate.labels" .root }}
app.kubernetes.io/component: engine
kvgate.io/engine: {{ .e.name }}
{{- end -}}

{{/*
The engine's flags after `kvgate serve` / `kvgate worker` (without host, port and serve-only flags): the model,
parallelism, then the engine's args. Called with (dict "root" $ "e" $e), renders a YAML list.
*/}}
{{- define "kvgate.engine.engineFlags" -}}
{{- $e := .e -}}
{{- if $e.model }}
- --model
- {{ printf "/models/%s" (toString $e.model) | quote }}
{{- end }}
{{- if or (gt (int $e.tensorParallelSize) 1) $e.multiNode.enabled }}
- --tensor-parallel-size
- {{ int $e.tensorParallelSize | quote }}
{{- end }}
{{- if gt (int $e.pipelineParallelSize) 1 }}
- --pipeline-parallel-size
- {{ int $e.pipelineParallelSize | quote }}
{{- end }}
{{- range $e.args }}
- {{ include "kvgate.arg" . | quote }}
{{- end }}
{{- end -}}

{{/*
The container args. role: "serve" (a Deployment's pod or a LeaderWorkerSet's leader) or "worker".
The command is the image's ENTRYPOINT (tini -- kvgate) unless image.command is set.
*/}}
{{- define "kvgate.engine.args" -}}
{{- $e := .e -}}
{{- if eq .role "worker" }}
- worker
{{- include "kvgate.engine.engineFlags" . }}
{{- else }}
- serve
- --host
- 0.0.0.0
- --port
- "8000"
- --served-model-name
- {{ include "kvgate.engine.servedModelName" $e | quote }}
- --shutdown-timeout
- {{ include "kvgate.arg" $e.shutdownTimeout | quote }}
{{- include "kvgate.engine.engineFlags" . }}
{{- if $e.multiNode.enabled }}
- --distributed-executor-backend
- external_launcher
{{- end }}
{{- range $e.serveArgs }}
- {{ include "kvgate.arg" . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
torch.distributed's environment of a LeaderWorkerSet pod (one rank per pod). LWS puts LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE and LWS_WORKER_INDEX at the front of the container's env, so $(...) references to them expand.
*/}}
{{- define "kvgate.engine.distributedEnv" -}}
{{- $e := .e }}
- name: RANK
  value: {{ ternary "0" "$(LWS_WORKER_INDEX)" (eq .role "serve") | quote }}
- name: LOCAL_RANK
  value: "0"
- name: WORLD_SIZE
  value: {{ mul (int $e.tensorParallelSize) (int $e.pipelineParallelSize) | quote }}
- name: MASTER_ADDR
  value: $(LWS_LEADER_ADDRESS)
- name: MASTER_PORT
  value: {{ int $e.multiNode.masterPort | quote }}
{{- end -}}

{{/*
The pod spec of an engine. Called with (dict "root" $ "e" $e "role" "serve"|"worker"): "serve" pods run
`kvgate serve`, listen on 8000 and have probes; "worker" pods (multiNode ranks 1..N-1) run `kvgate worker`.
*/}}
{{- define "kvgate.engine.podSpec" -}}
{{- $root := .root -}}
{{- $e := .e -}}
{{- $gpu := int $e.gpu -}}
{{- $serve := eq .role "serve" -}}
{{- $resources := deepCopy ($e.resources | default dict) -}}
{{- if gt $gpu 0 -}}
{{- $limits := $resources.limits | default dict -}}
{{- $_ := set $limits $root.Values.gpuResourceName $gpu -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- if not (has $root.Values.modelStorage.type (list "none" "hostPath" "pvc")) -}}
{{- fail (printf "modelStorage.type must be none, hostPath or pvc, got %q" (toString $root.Values.modelStorage.type)) -}}
{{- end -}}
{{- if not (has $root.Values.cache.type (list "emptyDir" "pvc")) -}}
{{- fail (printf "cache.type must be emptyDir or pvc, got %q" (toString $root.Values.cache.type)) -}}
{{- end -}}
{{- $shm := or (gt $gpu 0) (gt (mul (int $e.tensorParallelSize) (int $e.pipelineParallelSize)) 1) -}}
serviceAccountName: {{ include "kvgate.serviceAccountName" $root }}
automountServiceAccountToken: {{ $root.Values.serviceAccount.automountToken }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $e.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $e.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ int $e.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
containers:
  - name: {{ ternary "engine" "worker" $serve }}
    image: {{ include "kvgate.image" (dict "root" $root "image" $e.image "gpu" (gt $gpu 0)) | quote }}
    imagePullPolicy: {{ include "kvgate.imagePullPolicy" (dict "root" $root "image" $e.image) }}
    {{- with $root.Values.image.command }}
    command:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    args:
      {{- include "kvgate.engine.args" (dict "root" $root "e" $e "role" .role) | trim | nindent 6 }}
    env:
      {{- if $e.multiNode.enabled }}
      {{- include "kvgate.engine.distributedEnv" (dict "e" $e "role" .role) | trim | nindent 6 }}
      {{- end }}
      # HOME on a writable volume (the root filesystem is read-only); compiled Triton kernels live with the cache
      - name: HOME
        value: /tmp
      - name: KVGATE_CACHE_DIR
        value: /cache
      - name: TRITON_CACHE_DIR
        value: /cache/triton
      {{- with $e.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if $serve }}
    ports:
      - name: http
        containerPort: 8000
        protocol: TCP
      {{- if $e.multiNode.enabled }}
      - name: dist
        containerPort: {{ int $e.multiNode.masterPort }}
        protocol: TCP
      {{- end }}
    startupProbe:
      {{- include "kvgate.probe" $e.startupProbe | nindent 6 }}
    readinessProbe:
      {{- include "kvgate.probe" $e.readinessProbe | nindent 6 }}
    livenessProbe:
      {{- include "kvgate.probe" $e.livenessProbe | nindent 6 }}
    {{- end }}
    {{- with include "kvgate.lifecycle" (dict "root" $root "seconds" (ternary $e.preStopSleepSeconds 0 $serve)) }}
    {{- . | trim | nindent 4 }}
    {{- end }}
    {{- with $resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    securityContext:
      {{- toYaml ($e.securityContext | default $root.Values.securityContext) | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: cache
        mountPath: /cache
      {{- if ne $root.Values.modelStorage.type "none" }}
      - name: models
        mountPath: /models
        readOnly: {{ $root.Values.modelStorage.readOnly }}
      {{- end }}
      {{- if $shm }}
      - name: dshm
        mountPath: /dev/shm
      {{- end }}
      {{- with $e.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  - name: tmp
    emptyDir:
      sizeLimit: {{ $e.tmpSizeLimit }}
  - name: cache
    {{- if eq $root.Values.cache.type "pvc" }}
    persistentVolumeClaim:
      claimName: {{ $root.Values.cache.persistentVolumeClaim.existingClaim | default (printf "%s-cache" (include "kvgate.fullname" $root)) }}
    {{- else }}
    emptyDir:
      {{- with $root.Values.cache.emptyDir.sizeLimit }}
      sizeLimit: {{ . }}
      {{- end }}
    {{- end }}
  {{- if eq $root.Values.modelStorage.type "hostPath" }}
  - name: models
    hostPath:
      path: {{ required "modelStorage.hostPath.path is required with modelStorage.type hostPath" $root.Values.modelStorage.hostPath.path }}
      type: {{ $root.Values.modelStorage.hostPath.type }}
  {{- else if eq $root.Values.modelStorage.type "pvc" }}
  - name: models
    persistentVolumeClaim:
      claimName: {{ required "modelStorage.existingClaim is required with modelStorage.type pvc" $root.Values.modelStorage.existingClaim }}
      readOnly: {{ $root.Values.modelStorage.readOnly }}
  {{- end }}
  {{- if $shm }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $e.shmSizeLimit }}
  {{- end }}
  {{- with $e.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $e.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $e.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $e.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $e.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
An engine's autoscaling settings: .Values.autoscaling with the engine's own autoscaling map merged over it.
Called with (dict "root" $ "e" $e "out" $as).
*/}}
{{- define "kvgate.engine.autoscaling" -}}
{{- $as := .out -}}
{{- include "kvgate.deepMerge" (dict "dst" $as "src" (deepCopy .root.Values.autoscaling)) -}}
{{- include "kvgate.deepMerge" (dict "dst" $as "src" (deepCopy (.e.autoscaling | default dict))) -}}
{{- if $as.enabled -}}
{{- if not (has $as.kind (list "hpa" "keda")) -}}
{{- fail (printf "engines[%s].autoscaling.kind must be hpa or keda, got %q" .e.name (toString $as.kind)) -}}
{{- end -}}
{{- if or (lt (int $as.minReplicas) 1) (lt (int $as.maxReplicas) (int $as.minReplicas)) -}}
{{- fail (printf "engines[%s].autoscaling: need 1 <= minReplicas <= maxReplicas (the waiting queue is measured on running engines, so they cannot scale from zero)" .e.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
