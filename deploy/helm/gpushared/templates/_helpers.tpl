{{/* Labels every object carries; selectors use the app label alone, as deploy/'s kustomize manifests do. */}}
{{- define "gpushared.labels" -}}
app.kubernetes.io/name: gpushared
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The cluster's version as major.minor.patch: managed clusters report suffixes (v1.29.3-eks-1234567). */}}
{{- define "gpushared.kubeVersion" -}}
{{- regexFind "[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- end }}

{{/* policy/v1 from 1.21; policy/v1beta1 was removed in 1.25. */}}
{{- define "gpushared.pdbApiVersion" -}}
{{- if semverCompare ">=1.21.0-0" (include "gpushared.kubeVersion" .) }}policy/v1{{ else }}policy/v1beta1{{ end -}}
{{- end }}

{{/* KubeSchedulerConfiguration: v1 from 1.25, v1beta3 on 1.23-1.24, v1beta1 up to 1.22 (removed in 1.23). */}}
{{- define "gpushared.schedulerConfigApiVersion" -}}
{{- $v := include "gpushared.kubeVersion" . -}}
{{- if semverCompare ">=1.25.0-0" $v }}kubescheduler.config.k8s.io/v1
{{- else if semverCompare ">=1.23.0-0" $v }}kubescheduler.config.k8s.io/v1beta3
{{- else }}kubescheduler.config.k8s.io/v1beta1{{ end -}}
{{- end }}

{{- define "gpushared.extenderImage" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* kube-scheduler of the cluster's own version unless a tag is given. */}}
{{- define "gpushared.schedulerImage" -}}
{{ .Values.scheduler.image.repository }}:{{ .Values.scheduler.image.tag | default (printf "v%s" (include "gpushared.kubeVersion" .)) }}
{{- end }}

{{/* cert-manager or the chart: "true" when cert-manager issues the certificates. */}}
{{- define "gpushared.certManager" -}}
{{- $choice := toString .Values.tls.certManager -}}
{{- if eq $choice "auto" -}}
{{- .Capabilities.APIVersions.Has "cert-manager.io/v1" -}}
{{- else if or (eq $choice "true") (eq $choice "false") -}}
{{- $choice -}}
{{- else -}}
{{- fail (printf "tls.certManager must be auto, true or false, not %q" $choice) -}}
{{- end -}}
{{- end }}

{{/* The names the extender's certificate carries: its Service's DNS names, loopback (a static pod or a
     host-network scheduler beside it) and a fixed ClusterIP when one is given. */}}
{{- define "gpushared.extenderDnsNames" -}}
{{- $ns := .Release.Namespace -}}
{{- list (printf "gpushared-extender.%s.svc" $ns) (printf "gpushared-extender.%s.svc.cluster.local" $ns) | toJson -}}
{{- end }}
{{- define "gpushared.extenderIPs" -}}
{{- $ips := list "127.0.0.1" -}}
{{- with .Values.extender.clusterIP }}{{ $ips = append $ips . }}{{ end -}}
{{- $ips | toJson -}}
{{- end }}

{{/* Anti-affinity: replicas prefer different nodes, unless the operator gave an affinity. */}}
{{- define "gpushared.spread" -}}
{{- if .affinity }}
{{- toYaml .affinity }}
{{- else }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels: {app: {{ .app }}}
{{- end }}
{{- end }}

{{/* What every container of the chart runs with. */}}
{{- define "gpushared.securityContext" -}}
runAsNonRoot: true
runAsUser: 65534
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: ["ALL"]}
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/* The certificates the chart makes when cert-manager does not: a CA, the extender's serving certificate
     (also its client certificate when a follower forwards to the leader) and kube-scheduler's client
     certificate, ECDSA P-256 as scripts/extender-certs makes them. Each is kept from the Secret already in
     the cluster (lookup) while it names what it must and is valid for more than tls.renewBeforeDays, and is
     issued again otherwise: `helm upgrade` in that window renews it, and a new CA reissues both leaves.
     Made once per render and cached in .Values, so that every template sees the same keys. Returns JSON. */}}
{{- define "gpushared.tls" -}}
{{- if not (hasKey .Values "gpusharedGeneratedTls") -}}
{{- $ns := .Release.Namespace -}}
{{- $now := now | unixEpoch | int64 -}}
{{- $margin := mul (int64 .Values.tls.renewBeforeDays) 86400 -}}
{{- $days := int .Values.tls.days -}}
{{- if le $days (int .Values.tls.renewBeforeDays) -}}
{{- fail (printf "tls.days (%d) must be more than tls.renewBeforeDays (%d)" $days (int .Values.tls.renewBeforeDays)) -}}
{{- end -}}
{{- $caDays := mul $days 10 | int -}}
{{- $out := dict -}}
{{- $old := lookup "v1" "Secret" $ns "gpushared-ca" | default dict -}}
{{- $ca := "" -}}
{{- if and $old.data (gt (dig "metadata" "annotations" "gpushared.io/not-after" "0" $old | int64) (add $now $margin)) -}}
{{- $ca = buildCustomCert (index $old.data "tls.crt") (index $old.data "tls.key") -}}
{{- $_ := set $out "ca" (dict "crt" $ca.Cert "key" $ca.Key "notAfter" (dig "metadata" "annotations" "gpushared.io/not-after" "0" $old)) -}}
{{- else -}}
{{- $ca = genCAWithKey "gpushared-ca" $caDays (genPrivateKey "ecdsa") -}}
{{- $_ := set $out "ca" (dict "crt" $ca.Cert "key" $ca.Key "notAfter" (add $now (mul $caDays 86400) | toString)) -}}
{{- end -}}
{{- $leaves := list
      (dict "secret" "gpushared-extender-tls" "cn" "gpushared-extender"
            "ips" (include "gpushared.extenderIPs" . | fromJsonArray)
            "dns" (include "gpushared.extenderDnsNames" . | fromJsonArray))
      (dict "secret" "gpushared-scheduler-tls" "cn" "system:kube-scheduler" "ips" list "dns" list) -}}
{{- range $leaf := $leaves -}}
{{- $names := concat $leaf.ips $leaf.dns | join "," -}}
{{- $prev := lookup "v1" "Secret" $ns $leaf.secret | default dict -}}
{{- $keep := and $prev.data
      (eq (index $prev.data "ca.crt" | default "" | b64dec) $out.ca.crt)
      (eq (dig "metadata" "annotations" "gpushared.io/names" "" $prev) $names)
      (gt (dig "metadata" "annotations" "gpushared.io/not-after" "0" $prev | int64) (add $now $margin)) -}}
{{- if $keep -}}
{{- $_ := set $out $leaf.secret (dict "crt" (index $prev.data "tls.crt" | b64dec) "key" (index $prev.data "tls.key" | b64dec)
      "names" $names "notAfter" (dig "metadata" "annotations" "gpushared.io/not-after" "0" $prev)) -}}
{{- else -}}
{{- $cert := genSignedCertWithKey $leaf.cn $leaf.ips $leaf.dns $days $ca (genPrivateKey "ecdsa") -}}
{{- $_ := set $out $leaf.secret (dict "crt" $cert.Cert "key" $cert.Key "names" $names
      "notAfter" (add $now (mul $days 86400) | toString)) -}}
{{- end -}}
{{- end -}}
{{- $_ := set .Values "gpusharedGeneratedTls" $out -}}
{{- end -}}
{{- .Values.gpusharedGeneratedTls | toJson -}}
{{- end }}

{{/* The extender's CA, base64, for the webhook's caBundle ('' under cert-manager, which injects it). */}}
{{- define "gpushared.caBundle" -}}
{{- if ne (include "gpushared.certManager" .) "true" -}}
{{- (include "gpushared.tls" . | fromJson).ca.crt | b64enc -}}
{{- end -}}
{{- end }}
