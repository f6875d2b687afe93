{{/* Names ------------------------------------------------------------------ */}}

{{- define "aep-bridge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "aep-bridge.fullname" -}}
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

{{/* "<fullname>-<component>", for a dict {ctx, component} */}}
{{- define "aep-bridge.componentName" -}}
{{- printf "%s-%s" (include "aep-bridge.fullname" .ctx | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "aep-bridge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "aep-bridge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels ----------------------------------------------------------------- */}}

{{- define "aep-bridge.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "aep-bridge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: aep-bridge
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* for a dict {ctx, component} */}}
{{- define "aep-bridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "aep-bridge.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "aep-bridge.componentLabels" -}}
{{ include "aep-bridge.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image ------------------------------------------------------------------ */}}

{{- define "aep-bridge.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* NATS ------------------------------------------------------------------- */}}

{{/* Service name of the bundled NATS chart (mirrors its nats.fullname). */}}
{{- define "aep-bridge.natsFullname" -}}
{{- $nats := .Values.nats | default dict }}
{{- if $nats.fullnameOverride }}
{{- $nats.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default "nats" $nats.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Client port of the bundled NATS server (nats.config.nats.port, default 4222). */}}
{{- define "aep-bridge.natsPort" -}}
{{- $port := 4222 }}
{{- with .Values.nats.config }}{{- with .nats }}{{- with .port }}{{- $port = . }}{{- end }}{{- end }}{{- end }}
{{- $port | int }}
{{- end }}

{{/*
The URL(s) of the bundled server. A cluster (nats.config.cluster.enabled): one URL per
server pod, `<statefulset>-<i>.<headless service>.<namespace>.svc` (the names the NATS
chart gives them, overridable with nats.statefulSet.name / nats.headlessService.name),
so a client holds every server and reconnects to the next at once when one goes.
One server: the client Service.
*/}}
{{- define "aep-bridge.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- $scheme := ternary "tls" "nats" .Values.tls.enabled }}
{{- $port := include "aep-bridge.natsPort" . }}
{{- $cluster := dict }}
{{- with .Values.nats.config }}{{- with .cluster }}{{- $cluster = . }}{{- end }}{{- end }}
{{- if $cluster.enabled }}
{{- $sts := include "aep-bridge.natsFullname" . }}
{{- with .Values.nats.statefulSet }}{{- with .name }}{{- $sts = . }}{{- end }}{{- end }}
{{- $headless := printf "%s-headless" (include "aep-bridge.natsFullname" .) }}
{{- with .Values.nats.headlessService }}{{- with .name }}{{- $headless = . }}{{- end }}{{- end }}
{{- $urls := list }}
{{- range $i := until (int (default 3 $cluster.replicas)) }}
{{- $urls = append $urls (printf "%s://%s-%d.%s.%s.svc:%s" $scheme $sts $i $headless $.Release.Namespace $port) }}
{{- end }}
{{- join "," $urls }}
{{- else }}
{{- $svc := include "aep-bridge.natsFullname" . }}
{{- with .Values.nats.service }}{{- with .name }}{{- $svc = . }}{{- end }}{{- end }}
{{- printf "%s://%s.%s.svc:%s" $scheme $svc .Release.Namespace $port }}
{{- end }}
{{- else }}
{{- required "nats.url is required when nats.enabled is false (the URL of your NATS server)" .Values.nats.url }}
{{- end }}
{{- end }}

{{/* Environment ------------------------------------------------------------ */}}

{{/* The Secret a role reads its NATS credentials from. dict {ctx, role} */}}
{{- define "aep-bridge.authSecret" -}}
{{- $role := get .ctx.Values.auth .role }}
{{- $name := default .ctx.Values.auth.existingSecret $role.existingSecret }}
{{- required (printf "auth.existingSecret (or auth.%s.existingSecret) is required when auth.type is %s" .role .ctx.Values.auth.type) $name }}
{{- end }}

{{- define "aep-bridge.validate" -}}
{{- $types := list "userPassword" "token" "nkey" "creds" "none" }}
{{- if not (has .Values.auth.type $types) }}
{{- fail (printf "auth.type must be one of %s, got %q" (join ", " $types) .Values.auth.type) }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.existingSecret is required when tls.enabled is true" }}
{{- end }}
{{- if lt (int .Values.config.partitions) 1 }}
{{- fail "config.partitions must be at least 1" }}
{{- end }}
{{- end }}

{{/*
The AEP_BRIDGE_* variables of one container: dict {ctx, role, metricsPort}.
The names and meanings are the contract of docs/ARCHITECTURE.md.
*/}}
{{- define "aep-bridge.env" -}}
{{- $v := .ctx.Values -}}
- name: AEP_BRIDGE_NATS_URL
  value: {{ include "aep-bridge.natsUrl" .ctx | quote }}
{{- if eq $v.auth.type "userPassword" }}
- name: AEP_BRIDGE_NATS_USER
  value: {{ (get $v.auth .role).username | quote }}
- name: AEP_BRIDGE_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "aep-bridge.authSecret" . }}
      key: {{ printf "%s-password" .role }}
{{- else if eq $v.auth.type "token" }}
- name: AEP_BRIDGE_NATS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "aep-bridge.authSecret" . }}
      key: {{ printf "%s-token" .role }}
{{- else if eq $v.auth.type "nkey" }}
- name: AEP_BRIDGE_NATS_NKEY_SEED
  value: /etc/aep-bridge/nats/nkey.seed
{{- else if eq $v.auth.type "creds" }}
- name: AEP_BRIDGE_NATS_CREDS
  value: /etc/aep-bridge/nats/nats.creds
{{- end }}
{{- if $v.tls.enabled }}
- name: AEP_BRIDGE_TLS_CA
  value: {{ printf "/etc/aep-bridge/tls/%s" $v.tls.caKey | quote }}
{{- if $v.tls.clientCert }}
- name: AEP_BRIDGE_TLS_CERT
  value: {{ printf "/etc/aep-bridge/tls/%s" $v.tls.certKey | quote }}
- name: AEP_BRIDGE_TLS_KEY
  value: {{ printf "/etc/aep-bridge/tls/%s" $v.tls.keyKey | quote }}
{{- end }}
{{- end }}
- name: AEP_BRIDGE_PARTITIONS
  value: {{ $v.config.partitions | quote }}
- name: AEP_BRIDGE_CAPTURE
  value: {{ $v.config.capture | quote }}
- name: AEP_BRIDGE_CAPTURE_OVERRIDES
  value: {{ $v.config.captureOverrides | quote }}
{{- with $v.config.redactNames }}
- name: AEP_BRIDGE_REDACT_NAMES
  value: {{ join "," . | quote }}
{{- end }}
{{- /* bootstrap creates the streams; the gate creates its own buckets at start */}}
{{- if has .role (list "bootstrap" "gate") }}
{{- with $v.bootstrap.streamReplicas }}
- name: AEP_BRIDGE_STREAM_REPLICAS
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- with .metricsPort }}
- name: AEP_BRIDGE_METRICS_PORT
  value: {{ . | quote }}
{{- end }}
- name: AEP_BRIDGE_LOG_FORMAT
  value: {{ $v.config.logFormat | quote }}
- name: AEP_BRIDGE_LOG_LEVEL
  value: {{ $v.config.logLevel | quote }}
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with (get $v .role).extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volume mounts and volumes of one container/pod: dict {ctx, role} */}}
{{- define "aep-bridge.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if has .ctx.Values.auth.type (list "nkey" "creds") }}
- name: nats-auth
  mountPath: /etc/aep-bridge/nats
  readOnly: true
{{- end }}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  mountPath: /etc/aep-bridge/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "aep-bridge.volumes" -}}
{{- $v := .ctx.Values -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ $v.tmpSizeLimit }}
{{- if has $v.auth.type (list "nkey" "creds") }}
- name: nats-auth
  secret:
    secretName: {{ include "aep-bridge.authSecret" . }}
    defaultMode: 0440
    items:
      {{- if eq $v.auth.type "nkey" }}
      - key: {{ printf "%s.nk" .role }}
        path: nkey.seed
      {{- else }}
      - key: {{ printf "%s.creds" .role }}
        path: nats.creds
      {{- end }}
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $v.tls.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $v.tls.caKey }}
        path: {{ $v.tls.caKey }}
      {{- if $v.tls.clientCert }}
      - key: {{ $v.tls.certKey }}
        path: {{ $v.tls.certKey }}
      - key: {{ $v.tls.keyKey }}
        path: {{ $v.tls.keyKey }}
      {{- end }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every component: dict {ctx, component} */}}
{{- define "aep-bridge.podCommon" -}}
{{- $v := .ctx.Values -}}
serviceAccountName: {{ include "aep-bridge.serviceAccountName" .ctx }}
automountServiceAccountToken: {{ $v.automountServiceAccountToken }}
enableServiceLinks: false
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "aep-bridge.podLabels" -}}
{{ include "aep-bridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: aep-bridge
{{- with .ctx.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A metrics-serving service container's probes: dict {probes} */}}
{{- define "aep-bridge.probes" -}}
startupProbe:
  httpGet:
    path: /healthz
    port: metrics
  {{- toYaml .probes.startupProbe | nindent 2 }}
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  {{- toYaml .probes.livenessProbe | nindent 2 }}
readinessProbe:
  httpGet:
    path: /readyz
    port: metrics
  {{- toYaml .probes.readinessProbe | nindent 2 }}
{{- end }}

{{/* PromQL selector of one component's scrape job: dict {ctx, component} */}}
{{- define "aep-bridge.promSelector" -}}
namespace="{{ .ctx.Release.Namespace }}",job="{{ include "aep-bridge.componentName" . }}"
{{- end }}
