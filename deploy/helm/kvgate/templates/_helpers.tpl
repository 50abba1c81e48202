{{/* Names, labels and the checks every render runs. */}}

{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.fullname" -}}
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

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels common to every resource. */}}
{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component (gateway, redis, engine). Call with (dict "root" $ "component" NAME). */}}
{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- /* The simulated engine's image: the kvgate image's `sim` build (Dockerfile KVGATE_EXTRAS=sim). */}}
{{- define "kvgate.simEngineImage" -}}
{{- $tag := default (printf "%s-sim" (default .Chart.AppVersion .Values.image.tag)) .Values.engineExample.sim.imageTag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "kvgate.agentImage" -}}
{{- $repo := default .Values.image.repository .Values.agent.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.agent.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* The Secret with the agent and admin tokens: the user's, or the one the chart creates. */}}
{{- define "kvgate.tokensSecretName" -}}
{{- default (printf "%s-tokens" (include "kvgate.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "kvgate.redisSecretName" -}}
{{- default (printf "%s-redis" (include "kvgate.fullname" .)) .Values.redis.existingSecret }}
{{- end }}

{{- define "kvgate.redisHost" -}}
{{- printf "%s-redis.%s.svc" (include "kvgate.fullname" .) .Release.Namespace }}
{{- end }}

{{/*
The env var names the gateway reads its tokens from: `auth.agent_token_env` and
`auth.admin_token_env` of the gateway config, with the gateway's own defaults when the config
does not name them. An explicit empty name means "no auth" for that token, as in the gateway.
*/}}
{{- define "kvgate.agentTokenEnv" -}}
{{- $auth := default dict .Values.gateway.config.auth }}
{{- if hasKey $auth "agent_token_env" }}{{ $auth.agent_token_env | default "" }}{{ else }}KVGATE_AGENT_TOKEN{{ end }}
{{- end }}

{{- define "kvgate.adminTokenEnv" -}}
{{- $auth := default dict .Values.gateway.config.auth }}
{{- if hasKey $auth "admin_token_env" }}{{ $auth.admin_token_env | default "" }}{{ else }}KVGATE_ADMIN_TOKEN{{ end }}
{{- end }}

{{/* True ("true") when the gateway pods share state through a Redis. */}}
{{- define "kvgate.sharedState" -}}
{{- $shared := default dict .Values.gateway.config.shared_state }}
{{- if or .Values.redis.enabled $shared.redis_url }}true{{ end }}
{{- end }}

{{/*
The gateway's config.yaml: the user's tree with `listen` written from gateway.ports. With tls.enabled,
`inventory.tls_cert` and `inventory.tls_key` point at the mounted Secret. The Redis URL
of the chart's own Redis is not written here (it carries a password): the gateway gets it from
KVGATE_SHARED_STATE__REDIS_URL, which the config loader applies over this file.
*/}}
{{- define "kvgate.configYaml" -}}
{{- $config := deepCopy .Values.gateway.config }}
{{- $_ := set $config "listen" (dict "http" (printf "0.0.0.0:%d" (int .Values.gateway.ports.http)) "inventory" (printf "0.0.0.0:%d" (int .Values.gateway.ports.inventory))) }}
{{- if .Values.tls.enabled }}
{{- $inventory := default dict (get $config "inventory") }}
{{- $_ := set $inventory "tls_cert" "/etc/kvgate/tls/tls.crt" }}
{{- $_ := set $inventory "tls_key" "/etc/kvgate/tls/tls.key" }}
{{- $_ := set $config "inventory" $inventory }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/*
Checks that no schema can express. Each fails the render with a message naming the values to
change, so `helm install` stops before anything reaches the cluster.
*/}}
{{- define "kvgate.validate" -}}
{{- $shared := default dict .Values.gateway.config.shared_state }}
{{- $maxPods := int .Values.gateway.replicas }}
{{- if .Values.autoscaling.enabled }}
{{- $maxPods = int .Values.autoscaling.maxReplicas }}
{{- if gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas) }}
{{- fail (printf "kvgate: autoscaling.minReplicas (%d) is above autoscaling.maxReplicas (%d)." (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if and (gt $maxPods 1) (not (include "kvgate.sharedState" .)) }}
{{- fail (printf "kvgate: %d gateway pods need shared state, or each keeps its own prefix index and routes blind to the others' decisions. Set redis.enabled=true (the chart runs a Redis) or gateway.config.shared_state.redis_url (an existing Redis), or run one gateway pod (gateway.replicas=1, autoscaling.maxReplicas=1)." $maxPods) }}
{{- end }}
{{- if and .Values.redis.enabled $shared.redis_url }}
{{- fail "kvgate: redis.enabled=true and gateway.config.shared_state.redis_url are both set: use the chart's Redis or an existing one, not both." }}
{{- end }}
{{- $inventory := default dict .Values.gateway.config.inventory }}
{{- if and .Values.tls.enabled (or $inventory.tls_cert $inventory.tls_key) }}
{{- fail "kvgate: with tls.enabled the chart sets gateway.config.inventory.tls_cert and tls_key to the mounted tls.secretName; do not set them too." }}
{{- end }}
{{- if hasKey .Values.gateway.config "listen" }}
{{- fail "kvgate: gateway.config.listen is written by the chart from gateway.ports.http and gateway.ports.inventory; set those instead." }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "kvgate: tls.enabled=true needs tls.secretName, a Secret with tls.crt, tls.key and ca.crt." }}
{{- end }}
{{- $telemetry := default dict .Values.gateway.config.telemetry }}
{{- if and .Values.metrics.serviceMonitor.enabled (hasKey $telemetry "metrics") (not $telemetry.metrics) }}
{{- fail "kvgate: metrics.serviceMonitor.enabled=true but gateway.config.telemetry.metrics=false: the gateway would serve no /metrics to scrape." }}
{{- end }}
{{- $server := default dict .Values.gateway.config.server }}
{{- $drain := addf (default 0 $server.drain_delay_s) (default 50 $server.shutdown_grace_s) }}
{{- if ge $drain (float64 .Values.gateway.terminationGracePeriodSeconds) }}
{{- fail (printf "kvgate: gateway.config.server.drain_delay_s + shutdown_grace_s (%v s) must stay below gateway.terminationGracePeriodSeconds (%v s), or the kubelet kills the pod while it drains." $drain .Values.gateway.terminationGracePeriodSeconds) }}
{{- end }}
{{- $limits := default dict (default dict .Values.gateway.resources).limits }}
{{- if and $server.workers $limits.cpu }}
{{- $cpu := toString $limits.cpu }}
{{- $millis := 0.0 }}
{{- if hasSuffix "m" $cpu }}
{{- $millis = float64 (trimSuffix "m" $cpu) }}
{{- else }}
{{- $millis = mulf (float64 $cpu) 1000.0 }}
{{- end }}
{{- if gt (mulf (float64 $server.workers) 1000.0) (addf $millis 999.0) }}
{{- fail (printf "kvgate: gateway.config.server.workers (%v) is above gateway.resources.limits.cpu (%v) rounded up: each worker is an event loop that needs a core. Lower the workers or raise the limit." $server.workers $limits.cpu) }}
{{- end }}
{{- end }}
{{- if and .Values.engineExample.enabled (not (include "kvgate.agentTokenEnv" .)) }}
{{- fail "kvgate: engineExample.enabled=true but gateway.config.auth.agent_token_env is empty: the example agents authenticate with the agent token." }}
{{- end }}
{{- end }}

{{/* Shared pieces of the pod specs. */}}
{{- define "kvgate.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.gateway.tmpSizeLimit }}
{{- end }}

{{- define "kvgate.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end }}

{{/*
The replica agent as a sidecar container of an engine pod. Put it in the pod's `containers`:

    containers:
      - name: engine
        ...
      {{- include "kvgate.agentSidecar" . | nindent 6 }}

and, with tls.enabled, `{{- include "kvgate.agentSidecarVolumes" . | nindent 6 }}` to the pod's
`volumes`.
The engine must publish KV events on agent.eventsEndpoint (and replay on agent.replayEndpoint);
for vLLM that is `--kv-events-config` (see the example engine template). The agent reports the
pod's name as the replica id and `http://POD_IP:agent.enginePort` as the replica's URL, reads the
agents' token from the tokens Secret, and needs no port of its own.
*/}}
{{- define "kvgate.agentSidecar" -}}
{{- include "kvgate.agentSidecarFor" (dict "root" . "blockSize" (int .Values.agent.blockSize)) }}
{{- end }}

{{/* The agent sidecar with an explicit block size: (dict "root" $ "blockSize" N), N = 0 to learn it from the engine. */}}
{{- define "kvgate.agentSidecarFor" -}}
{{- $root := .root -}}
{{- $tokenEnv := include "kvgate.agentTokenEnv" $root -}}
- name: kvgate-agent
  image: {{ include "kvgate.agentImage" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args:
    - agent
    - --replica-id
    - $(POD_NAME)
    - --engine-url
    - http://127.0.0.1:{{ $root.Values.agent.enginePort }}
    - --advertise-url
    - http://$(POD_IP):{{ $root.Values.agent.enginePort }}
    - --events
    - {{ $root.Values.agent.eventsEndpoint }}
    {{- with $root.Values.agent.replayEndpoint }}
    - --replay
    - {{ . }}
    {{- end }}
    - --gateway
    - {{ default (printf "%s.%s.svc:%d" (include "kvgate.fullname" $root) $root.Release.Namespace (int $root.Values.service.inventoryPort)) $root.Values.agent.gatewayAddress }}
    {{- if .blockSize }}
    - --block-size
    - {{ .blockSize | quote }}
    {{- end }}
    {{- if $tokenEnv }}
    - --token-env
    - {{ $tokenEnv }}
    {{- end }}
    {{- if $root.Values.tls.enabled }}
    - --tls-ca
    - /etc/kvgate/tls/ca.crt
    {{- end }}
    {{- with $root.Values.agent.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- if $tokenEnv }}
    - name: {{ $tokenEnv }}
      valueFrom:
        secretKeyRef:
          name: {{ include "kvgate.tokensSecretName" $root }}
          key: {{ $root.Values.auth.agentTokenKey }}
    {{- end }}
  resources:
    {{- toYaml $root.Values.agent.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.agent.securityContext | nindent 4 }}
  {{- if $root.Values.tls.enabled }}
  volumeMounts:
    - name: kvgate-agent-tls
      mountPath: /etc/kvgate/tls
      readOnly: true
  {{- end }}
{{- end }}

{{/* The volumes the agent sidecar mounts (only the CA with tls.enabled); add them to the engine pod's `volumes`. */}}
{{- define "kvgate.agentSidecarVolumes" -}}
{{- if .Values.tls.enabled }}
- name: kvgate-agent-tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}

{{/* HTTPS when the gateway serves its HTTP API over TLS (gateway.config.auth.http_tls), else HTTP: the probes' and the ServiceMonitor's scheme. */}}
{{- define "kvgate.httpScheme" -}}
{{- $auth := .Values.gateway.config.auth | default dict -}}
{{- $tls := $auth.http_tls | default dict -}}
{{- if $tls.cert }}HTTPS{{ else }}HTTP{{ end -}}
{{- end }}
