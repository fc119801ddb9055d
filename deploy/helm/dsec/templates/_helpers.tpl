{{/* The labels of a part (worker or gateway): as the kustomize base's. */}}
{{- define "dsec.labels" -}}
app.kubernetes.io/name: dsec
app.kubernetes.io/component: {{ . }}
{{- end }}

{{/* The container's image, and its pull policy when one is set. */}}
{{- define "dsec.image" -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}
