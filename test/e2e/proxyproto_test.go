package e2e

// The PROXY protocol toward real servers that parse it: HAProxy (accept-proxy)
// in pod1 and nginx (listen … proxy_protocol, $proxy_protocol_addr) in pod2,
// each behind a v1 and a v2 Service, reached through ClusterIPs and NodePorts
// over IPv4 and IPv6.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const haproxyConfig = `global
  maxconn 100
defaults
  mode http
  timeout connect 5s
  timeout client 10s
  timeout server 10s
frontend pp
  bind :9080 accept-proxy
  bind :::9080 v6only accept-proxy
  http-request return status 200 content-type text/plain lf-string "haproxy src=%[src]\n"
`

const nginxConfig = `daemon off;
pid %[1]s/nginx.pid;
error_log stderr;
events {}
http {
  log_format pp '$proxy_protocol_addr $remote_addr "$request"';
  access_log %[1]s/access.log pp;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  server {
    listen 9081 proxy_protocol;
    listen [::]:9081 proxy_protocol ipv6only=on;
    location / { return 200 "nginx src=$proxy_protocol_addr\n"; }
  }
}
`

// ppService is a dual-stack NodePort Service with the PROXY protocol version
// v, on ClusterIPs 10.96.2.n and fd00:96::2:n, NodePort 3180n, whose one
// endpoint is the pod at ip4/ip6 on port.
func ppService(n int, v, ip4, ip6 string, port int) string {
	name := fmt.Sprintf("pp%d", n)
	return fmt.Sprintf(`---
apiVersion: v1
kind: Service
metadata:
  name: %[1]s
  namespace: lab
  annotations: {kube-userspace-proxy.io/proxy-protocol: "%[2]s"}
spec:
  type: NodePort
  clusterIP: 10.96.2.%[3]d
  clusterIPs: [10.96.2.%[3]d, "fd00:96::2:%[3]d"]
  ipFamilies: [IPv4, IPv6]
  ports: [{name: h, port: 80, targetPort: %[6]d, protocol: TCP, nodePort: 3180%[3]d}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-v4, namespace: lab, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: h, port: %[6]d, protocol: TCP}]
endpoints: [{addresses: [%[4]s], nodeName: node}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-v6, namespace: lab, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv6
ports: [{name: h, port: %[6]d, protocol: TCP}]
endpoints: [{addresses: ["%[5]s"], nodeName: node}]
`, name, v, n, ip4, ip6, port)
}

func TestProxyProtocolWithHAProxyAndNginx(t *testing.T) {
	l := NewLab(t)
	dir := t.TempDir()
	hcfg := filepath.Join(dir, "haproxy.cfg")
	ncfg := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(hcfg, []byte(haproxyConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ncfg, []byte(fmt.Sprintf(nginxConfig, dir)), 0o644); err != nil {
		t.Fatal(err)
	}
	haproxy := l.Start("pod1", "haproxy", "-db", "-f", hcfg)
	nginx := l.Start("pod2", "nginx", "-c", ncfg, "-p", dir)
	for pod, port := range map[string]string{"pod1": "9080", "pod2": "9081"} {
		waitFor(t, pod+" listening", func() bool {
			out, _ := l.Exec(pod, "ss", "-ltn", "sport = :"+port)
			return strings.Count(out, "LISTEN") == 2
		})
	}
	m := filepath.Join(dir, "m.yaml")
	writeManifest(t, m,
		ppService(1, "v1", "10.251.19.12", "fd00:251::12", 9080)+ppService(2, "v2", "10.251.19.12", "fd00:251::12", 9080)+
			ppService(3, "v1", "10.251.19.8", "fd00:251::8", 9081)+ppService(4, "v2", "10.251.19.8", "fd00:251::8", 9081))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	waitFor(t, "the rules", func() bool { return countRules(t, l, `lab/pp4`) > 0 })

	for n := 1; n <= 4; n++ {
		server := map[bool]string{true: "haproxy", false: "nginx"}[n <= 2]
		for _, tc := range []struct{ from, url, client string }{
			{"client", fmt.Sprintf("http://10.96.2.%d/", n), "10.251.19.20"},
			{"client", fmt.Sprintf("http://[fd00:96::2:%d]/", n), "fd00:251::20"},
			{"ext", fmt.Sprintf("http://192.168.50.1:3180%d/", n), "192.168.50.2"},
			{"ext", fmt.Sprintf("http://[fd00:50::1]:3180%d/", n), "fd00:50::2"},
		} {
			want := server + " src=" + tc.client
			var got string
			waitFor(t, fmt.Sprintf("%s → %s (pp%d) answering", tc.from, tc.url, n), func() bool {
				got = l.Curl(tc.from, tc.url)
				return got != ""
			})
			if got != want {
				t.Errorf("%s → %s (pp%d): %q, want %q\n%s", tc.from, tc.url, n, got, want, tail(d.Output(), 5))
			}
		}
	}
	// nginx's access log has the client's address from the header, and the
	// node's as the connection's peer.
	log, _ := os.ReadFile(filepath.Join(dir, "access.log"))
	for _, want := range []string{"10.251.19.20 10.251.19.1 ", "192.168.50.2 10.251.19.1 ", "fd00:251::20 fd00:251::1 ", "fd00:50::2 fd00:251::1 "} {
		if !strings.Contains(string(log), want) {
			t.Errorf("nginx's access log lacks %q:\n%s", want, log)
		}
	}
	_, _ = haproxy, nginx
}
