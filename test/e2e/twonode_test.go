package e2e

import (
	"encoding/json"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// healthAnswer is a health check node port's body, as kube-proxy writes it.
type healthAnswer struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints      int  `json:"localEndpoints"`
	ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
}

// Two nodes, one API server: node (10.251.19.1, zone-a, pod1 on it) and
// node-b (10.251.19.40, zone-b, pod2 on it), each with its own daemon. What
// differs per node must differ: traffic policy Local, NodePorts, the health
// check node port, topology; and what kube-proxy does for load balancers:
// loadBalancerSourceRanges, /healthz while the node goes away.
func TestTwoNodes(t *testing.T) {
	// The proxy ports stay clear of the API server's (picked among the
	// ephemeral ports): node A's guard must let node B's daemon in.
	args := []string{"--proxy-port-range", "20000-20999"}
	cl := startClusterLab(t, clusterLabOptions{listenAll: true, daemonArgs: args})
	if out, err := cl.script("lab_node2"); err != nil {
		t.Fatalf("lab_node2: %v\n%s", err, out)
	}
	apiPort := cl.cp.URL[strings.LastIndex(cl.cp.URL, ":")+1:]
	kcB := cl.deployKubeconfig(t, "https://10.251.19.1:"+apiPort)
	daemonB := cl.Start("node2", append([]string{filepath.Join(binDir, "kube-userspace-proxy"), "--log-level", "debug",
		"--kubeconfig", kcB, "--hostname-override", "node-b", "--min-sync-period", "100ms",
		"--admin-socket", filepath.Join(t.TempDir(), "admin.sock"), "--handover-socket", filepath.Join(t.TempDir(), "handover.sock")}, args...)...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node-b's daemon log:\n%s", daemonB.Output())
		}
	})
	waitFor(t, "node-b's daemon to sync its caches", func() bool { return strings.Contains(daemonB.Output(), "msg=Started") })

	for node, zone := range map[string]string{"node": "zone-a", "node-b": "zone-b"} {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{v1.LabelTopologyZone: zone}}})
		if _, err := cl.admin.CoreV1().Nodes().Patch(cl.ctx, node, types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	cl.pod(t, "pod1", "10.251.19.12", "node", "web")
	cl.pod(t, "pod2", "10.251.19.8", "node-b", "web")
	local := v1.ServiceInternalTrafficPolicyLocal

	t.Run("internalTrafficPolicy Local", func(t *testing.T) {
		svc := webService("itp", "10.96.1.1")
		svc.Spec.Selector = map[string]string{"app": "web"}
		svc.Spec.InternalTrafficPolicy = &local
		cl.service(t, svc)
		cl.expectPods(t, "node", "http://10.96.1.1/", "pod1")
		cl.expectPods(t, "node2", "http://10.96.1.1/", "pod2")
	})

	t.Run("externalTrafficPolicy Local, NodePorts on both nodes", func(t *testing.T) {
		svc := webService("etp", "10.96.1.2")
		svc.Spec.Selector = map[string]string{"app": "web"}
		svc.Spec.Type = v1.ServiceTypeNodePort
		svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		svc.Spec.Ports[0].NodePort = 30081
		cl.service(t, svc)
		cl.expectPods(t, "client", "http://10.251.19.1:30081/", "pod1")
		cl.expectPods(t, "client", "http://10.251.19.40:30081/", "pod2")
		cl.expectPods(t, "client", "http://10.96.1.2/", "pod1", "pod2") // the ClusterIP: policy Cluster
	})

	// Both policies flipped in one update, as make differential's edit
	// does: each node's port keeps its listener and serves its own pod.
	t.Run("both policies flipped at once", func(t *testing.T) {
		svc := webService("flip", "10.96.1.9")
		svc.Spec.Selector = map[string]string{"app": "web"}
		svc.Spec.Type = v1.ServiceTypeNodePort
		svc.Spec.Ports[0].NodePort = 30082
		cl.service(t, svc)
		cl.expectPods(t, "client", "http://10.251.19.1:30082/", "pod1", "pod2")
		cl.updateService(t, "flip", func(s *v1.Service) {
			s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
			s.Spec.InternalTrafficPolicy = &local
		})
		cl.expectPods(t, "client", "http://10.251.19.1:30082/", "pod1")
		cl.expectPods(t, "client", "http://10.251.19.40:30082/", "pod2")
		cl.expectPods(t, "node", "http://10.96.1.9/", "pod1")
		cl.updateService(t, "flip", func(s *v1.Service) {
			s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
			s.Spec.InternalTrafficPolicy = nil
		})
		cl.expectPods(t, "client", "http://10.251.19.40:30082/", "pod1", "pod2")
	})

	t.Run("health check node port and loadBalancerSourceRanges", func(t *testing.T) {
		svc := webService("lb", "10.96.1.3")
		svc.Spec.Selector = map[string]string{"app": "web"}
		svc.Spec.Type = v1.ServiceTypeLoadBalancer
		svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		svc.Spec.LoadBalancerSourceRanges = []string{"10.251.19.0/24"}
		svc.Namespace = "lab"
		created, err := cl.admin.CoreV1().Services("lab").Create(cl.ctx, svc, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		created.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "203.0.113.50"}}
		if _, err := cl.admin.CoreV1().Services("lab").UpdateStatus(cl.ctx, created, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		hc := created.Spec.HealthCheckNodePort
		if hc == 0 {
			t.Fatal("the API server allocated no healthCheckNodePort")
		}
		check := func(nodeIP string) (int, healthAnswer) {
			code, body := cl.get("client", "http://"+nodeIP+":"+strconv.Itoa(int(hc))+"/")
			var a healthAnswer
			_ = json.Unmarshal([]byte(body), &a)
			return code, a
		}
		for _, nodeIP := range []string{"10.251.19.1", "10.251.19.40"} {
			waitFor(t, "health check node port 200 on "+nodeIP, func() bool {
				code, a := check(nodeIP)
				return code == 200 && a.LocalEndpoints == 1 && a.ServiceProxyHealthy && a.Service.Name == "lb" && a.Service.Namespace == "lab"
			})
		}
		// node-b's only endpoint stops being ready: its load balancer
		// check fails, node's does not.
		cl.setReady(t, "pod2", "10.251.19.8", false)
		waitFor(t, "health check node port 503 on node-b", func() bool {
			code, a := check("10.251.19.40")
			return code == 503 && a.LocalEndpoints == 0 && a.ServiceProxyHealthy
		})
		if code, a := check("10.251.19.1"); code != 200 || a.LocalEndpoints != 1 {
			t.Fatalf("node: %d %+v", code, a)
		}
		cl.setReady(t, "pod2", "10.251.19.8", true)

		// Source ranges: the pods' network gets in through the
		// LoadBalancer IP, the external client does not; the NodePort
		// and the ClusterIP are not limited.
		cl.expectPods(t, "client", "http://203.0.113.50/", "pod1")
		if out, err := cl.Exec("ext", "curl", "-s", "--max-time", "2", "http://203.0.113.50/"); err == nil {
			t.Fatalf("a client outside loadBalancerSourceRanges reached the LoadBalancer IP: %q", out)
		}
		np := int(created.Spec.Ports[0].NodePort)
		cl.expectPods(t, "ext", "http://192.168.50.1:"+strconv.Itoa(np)+"/", "pod1")
		// A change of the ranges applies at the next sync.
		cl.updateService(t, "lb", func(s *v1.Service) { s.Spec.LoadBalancerSourceRanges = []string{"192.168.50.0/24"} })
		cl.expectPods(t, "ext", "http://203.0.113.50/", "pod1")
		waitFor(t, "the pods' network shut out", func() bool {
			_, err := cl.Exec("client", "curl", "-s", "--max-time", "1", "http://203.0.113.50/")
			return err != nil
		})
		// explain says why, from the installed rules.
		q := url.Values{"from": {"10.251.19.20"}, "to": {"203.0.113.50:80"}, "format": {"text"}}
		if _, text := cl.get(
			"node",
			"http://127.0.0.1:10249/debug/explain?"+q.Encode(),
		); !strings.Contains(
			text,
			"outside the Service's loadBalancerSourceRanges",
		) {
			t.Fatalf("explain:\n%s", text)
		}
	})

	t.Run("topology: PreferSameZone", func(t *testing.T) {
		svc := webService("zoned", "10.96.1.4")
		svc.Spec.Selector = map[string]string{"app": "web"}
		svc.Spec.TrafficDistribution = ptr(v1.ServiceTrafficDistributionPreferSameZone)
		cl.service(t, svc)
		cl.expectPods(t, "node", "http://10.96.1.4/", "pod1")
		cl.expectPods(t, "node2", "http://10.96.1.4/", "pod2")
		cl.expectPods(t, "client", "http://10.96.1.4/", "pod1") // pods go through their node: node is zone-a
		q := url.Values{"from": {"10.251.19.40"}, "to": {"10.96.1.4:80"}}
		_, body := cl.get("node2", "http://127.0.0.1:10249/debug/explain?"+q.Encode())
		if !strings.Contains(body, `"topology": "PreferSameZone"`) || !strings.Contains(body, `"zone": "zone-b"`) {
			t.Fatalf("node-b's explain:\n%s", body)
		}
		if _, text := cl.get("node2", "http://127.0.0.1:10249/debug/services?format=text"); !strings.Contains(text, `topology: trafficDistribution "PreferSameZone", hints PreferSameZone, zone "zone-b"`) ||
			!strings.Contains(text, "node=node-b hints=zone-b") {
			t.Fatalf("node-b's /debug/services:\n%s", text)
		}
		// Without hints for its zone a node uses every endpoint: pod2
		// leaves, node-b falls back to pod1.
		cl.setReady(t, "pod2", "10.251.19.8", false)
		cl.expectPods(t, "node2", "http://10.96.1.4/", "pod1")
		cl.setReady(t, "pod2", "10.251.19.8", true)
		cl.expectPods(t, "node2", "http://10.96.1.4/", "pod2")
	})

	t.Run("a node going away fails /healthz, not /livez", func(t *testing.T) {
		taint := func(on bool) {
			n, err := cl.admin.CoreV1().Nodes().Get(cl.ctx, "node-b", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			n.Spec.Taints = nil
			if on {
				n.Spec.Taints = []v1.Taint{
					{Key: "ToBeDeletedByClusterAutoscaler", Value: strconv.Itoa(int(time.Now().Unix())), Effect: v1.TaintEffectNoSchedule},
				}
			}
			if _, err := cl.admin.CoreV1().Nodes().Update(cl.ctx, n, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		code := func(ns, path string) int { c, _ := cl.get(ns, "http://127.0.0.1:10256"+path); return c }
		waitFor(t, "node-b healthy", func() bool { return code("node2", "/healthz") == 200 })
		taint(true)
		waitFor(t, "node-b's /healthz failing while it is tainted for removal", func() bool { return code("node2", "/healthz") == 503 })
		if c := code("node2", "/livez"); c != 200 {
			t.Fatalf("/livez %d while the node goes away: it must not restart the daemon", c)
		}
		if c := code("node", "/healthz"); c != 200 {
			t.Fatalf("the other node's /healthz: %d", c)
		}
		_, body := cl.get("node2", "http://127.0.0.1:10256/healthz")
		if !strings.Contains(body, `"nodeEligible":false`) {
			t.Fatalf("/healthz body %s", body)
		}
		taint(false)
		waitFor(t, "node-b's /healthz back", func() bool { return code("node2", "/healthz") == 200 })
	})
}
