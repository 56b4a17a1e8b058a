{{/* Names and labels. */}}
{{- define "braid.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "braid.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "braid.labels" -}}
{{ include "braid.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Redis: the bundled StatefulSet's Service, or the external URL. */}}
{{- define "braid.redisHost" -}}{{ include "braid.fullname" . }}-redis{{- end -}}

{{- define "braid.redisUrl" -}}
{{- if eq .Values.redis.mode "external" -}}
{{- required "redis.external.url is required when redis.mode is external (redis://host:6379/0)" .Values.redis.external.url -}}
{{- else -}}redis://{{ include "braid.redisHost" . }}:6379/0{{- end -}}
{{- end -}}

{{/* GCS fault tolerance takes host:port (rediss:// kept for TLS): no database, no password in it. */}}
{{- define "braid.redisAddress" -}}
{{- if eq .Values.redis.mode "external" -}}
{{- $url := urlParse (include "braid.redisUrl" .) -}}
{{- if eq $url.scheme "rediss" }}rediss://{{ end }}{{ $url.host | splitList "@" | last -}}
{{- else -}}{{ include "braid.redisHost" . }}:6379{{- end -}}
{{- end -}}

{{- define "braid.apiKeysFile" -}}/etc/braid/api-keys/{{ .Values.apiKeys.secretKey }}{{- end -}}

{{/* Whether the agent API checks keys: unless apiKeys.open, which must not name a Secret too. */}}
{{- define "braid.apiKeysOn" -}}
{{- if .Values.apiKeys.open -}}
{{- if .Values.apiKeys.secretName -}}{{- fail (printf "apiKeys.open serves the agent API without keys, but apiKeys.secretName names Secret %s: set one or the other" .Values.apiKeys.secretName) -}}{{- end -}}
{{- else -}}true{{- end -}}
{{- end -}}

{{/* The cluster config the Serve application gets: the user's `config` values plus what the chart owns. */}}
{{- define "braid.clusterConfig" -}}
{{- $c := deepCopy .Values.config -}}
{{- $_ := set $c "model_path" .Values.model.path -}}
{{- $_ := set $c "redis_url" (include "braid.redisUrl" .) -}}
{{- $_ := set $c "grpc_port" (int .Values.grpcPort) -}}
{{- if include "braid.apiKeysOn" . -}}{{- $_ := set $c "api_keys_file" (include "braid.apiKeysFile" .) -}}{{- end -}}
{{- $_ := set $c "synthesizer_resources" (dict "braid_synthesizer" 1) -}}
{{- if not $c.colocate -}}{{- $_ := set $c "worker_resources" (dict "braid_worker" 1) -}}{{- end -}}
{{- /* GPUs per replica decided here, from the groups' GPUs, not on whichever node builds the app */ -}}
{{- range $key, $group := dict "gpus_per_synthesizer" "synthesizers" "gpus_per_worker" "workers" -}}
{{- if not (hasKey $c $key) -}}{{- $_ := set $c $key (include "braid.gpusEach" (dict "root" $ "key" $key "group" $group) | atoi) -}}{{- end -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}

{{/* Ray Serve's deploy config: what `braid serve-config` prints for the same cluster config. */}}
{{- define "braid.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
grpc_options:
  port: {{ int .Values.grpcPort }}
  grpc_servicer_functions:
  - braid.cluster.grpc_proxy.add_agent_service
applications:
- name: braid
  route_prefix: /braid
  import_path: braid.cluster.deploy:app_builder
  args:
    config:
      {{- include "braid.clusterConfig" . | nindent 6 }}
{{- end -}}

{{/* Pods of one role's group: ceil(replicas / replicasPerPod). */}}
{{- define "braid.pods" -}}
{{- $per := int .group.replicasPerPod -}}
{{- div (add (int .replicas) (sub $per 1)) $per -}}
{{- end -}}

{{/* A Ray pod template. Takes dict: root, group (head or a worker group's values), node ("head" or a role). */}}
{{- define "braid.podTemplate" -}}
{{- $root := .root -}}
metadata:
  labels:
    {{- include "braid.labels" $root | nindent 4 }}
    braid.dev/node: {{ .node }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
  - name: ray-{{ .node }}
    image: {{ printf "%s:%s" $root.Values.image.repository $root.Values.image.tag | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    ports:
    {{- if eq .node "head" }}
    - {containerPort: 6379, name: gcs-server}
    - {containerPort: 8265, name: dashboard}
    - {containerPort: 10001, name: client}
    {{- end }}
    - {containerPort: 8000, name: serve}
    - {containerPort: {{ int $root.Values.grpcPort }}, name: grpc}
    - {containerPort: 8080, name: metrics}
    env:
    - {name: BRAID_MODEL, value: {{ $root.Values.model.path | quote }}}
    - name: BRAID_CLUSTER_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ include "braid.clusterTokenSecret" $root }}, key: {{ $root.Values.clusterToken.secretKey | quote }}}
    {{- if $root.Values.redis.password.secretName }}
    - name: BRAID_REDIS_PASSWORD
      valueFrom:
        secretKeyRef: {name: {{ $root.Values.redis.password.secretName }}, key: {{ $root.Values.redis.password.secretKey }}}
    {{- end }}
    resources:
      {{- $resources := deepCopy (.group.resources | default dict) }}
      {{- if gt (int (.group.gpus | default 0)) 0 }}
      {{- $limits := $resources.limits | default dict }}
      {{- $_ := set $limits "nvidia.com/gpu" (int .group.gpus) }}
      {{- $_ := set $resources "limits" $limits }}
      {{- end }}
      {{- toYaml $resources | nindent 6 }}
    volumeMounts:
    - {name: shm, mountPath: /dev/shm}
    {{- if or $root.Values.model.persistentVolumeClaim $root.Values.model.hostPath }}
    - {name: model, mountPath: {{ $root.Values.model.path | quote }}, readOnly: true}
    {{- end }}
    {{- if include "braid.apiKeysOn" $root }}
    - {name: api-keys, mountPath: /etc/braid/api-keys, readOnly: true}
    {{- end }}
  volumes:
  - name: shm
    emptyDir: {medium: Memory}
  {{- if $root.Values.model.persistentVolumeClaim }}
  - name: model
    persistentVolumeClaim: {claimName: {{ $root.Values.model.persistentVolumeClaim }}, readOnly: true}
  {{- else if $root.Values.model.hostPath }}
  - name: model
    hostPath: {path: {{ $root.Values.model.hostPath | quote }}, type: Directory}
  {{- end }}
  {{- if include "braid.apiKeysOn" $root }}
  - name: api-keys
    secret: {secretName: {{ include "braid.apiKeysSecret" $root }}}
  {{- end }}
{{- end -}}


{{/* GPUs each replica of a role takes: config.gpus_per_<role> when set, else 1 when its group has GPUs. */}}
{{- define "braid.gpusEach" -}}
{{- $set := index .root.Values.config .key -}}
{{- if hasKey .root.Values.config .key -}}{{ $set }}
{{- else -}}{{ ternary 1 0 (gt (int (index .root.Values.workerGroups .group).gpus) 0) }}{{- end -}}
{{- end -}}

{{/* The Secret holding the API keys: the one named in values, else the chart's own. */}}
{{- define "braid.apiKeysSecret" -}}
{{- .Values.apiKeys.secretName | default (printf "%s-api-keys" (include "braid.fullname" .)) -}}
{{- end }}

{{/* The Secret holding the cluster token: the one named in values, else the chart's own. */}}
{{- define "braid.clusterTokenSecret" -}}
{{- .Values.clusterToken.secretName | default (printf "%s-cluster-token" (include "braid.fullname" .)) -}}
{{- end }}
