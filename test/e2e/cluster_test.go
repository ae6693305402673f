package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// clusterLab is a lab whose node namespace also runs a real control plane;
// the daemon watches it with the shipped ClusterRole's permissions only.
type clusterLab struct {
	*Lab
	cp     *cluster.ControlPlane
	admin  *kubernetes.Clientset
	daemon *Proc
	ctx    context.Context
	// tokenMu guards token and tokenFiles: the refresher rewrites them.
	tokenMu    sync.Mutex
	token      string   // the shipped ServiceAccount's, for more daemons
	tokenFiles []string // where deployKubeconfig wrote it
	// kubeconfig is docs/deploy's, for daemons the test starts itself.
	kubeconfig string
}

// clusterLabOptions vary the lab: listenAll serves the API server on the
// node's addresses (for the daemons of other nodes), daemonArgs are added
// to the daemon's command line; noDaemon leaves the daemon to the test.
type clusterLabOptions struct {
	listenAll  bool
	daemonArgs []string
	noDaemon   bool
}

func newClusterLab(t *testing.T) *clusterLab { return startClusterLab(t, clusterLabOptions{}) }

// clusterTurn is held by the test whose cluster lab is up.
var clusterTurn = make(chan struct{}, 1)

// startClusterLab brings a cluster lab up for t, once every test of the
// package that needs none has run, and one test at a time: on a fresh
// machine the control plane is still building meanwhile (make test builds
// it beside its first steps, test/suite.sh), so those others need not wait
// for it. Call it before anything else the test does that must not run
// beside other tests.
func startClusterLab(t *testing.T, o clusterLabOptions) *clusterLab {
	t.Helper()
	requireRoot(t)
	t.Parallel() // resumes when the package's sequential tests are done
	clusterTurn <- struct{}{}
	t.Cleanup(func() { <-clusterTurn }) // the first cleanup registered runs last: after the lab's
	bins, err := cluster.BinDir(repoRoot, testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	l := NewLab(t)
	ctx := context.Background()
	cp, err := cluster.Start(ctx, cluster.Options{BinDir: bins, Dir: t.TempDir(), Netns: l.NS("node"), ListenAll: o.listenAll})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cp.Stop)
	rc := &rest.Config{Host: cp.URL, BearerToken: cp.AdminToken, TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial: cluster.DialContextIn(l.NS("node"))}
	admin, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	cl := &clusterLab{Lab: l, cp: cp, admin: admin, ctx: ctx}
	cl.applyDeployManifests(t)
	cl.mustCreate(t, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "lab"}})
	cl.mustCreate(t, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: "lab"}})
	for _, n := range []string{"node", "node-b"} {
		cl.mustCreate(t, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}})
	}

	// The daemon gets a token of the shipped ServiceAccount, not the
	// admin's, valid for an hour and renewed in place as a kubelet renews
	// a pod's projected token (a soak outlives it).
	token, err := cl.newToken()
	if err != nil {
		t.Fatal(err)
	}
	cl.token = token
	cl.renewTokens(t)
	kc := cl.deployKubeconfig(t, cp.URL)
	cl.kubeconfig = kc
	l.Backends()
	l.Start("client", filepath.Join(binDir, "backend"), "--name", "pod3", "--tcp", ":8080", "--udp", "")
	if o.noDaemon {
		return cl
	}
	cl.daemon = l.Daemon(append([]string{"--kubeconfig", kc, "--hostname-override", "node", "--min-sync-period", "100ms"}, o.daemonArgs...)...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", cl.daemon.Output())
		}
	})
	waitFor(t, "the daemon to sync its caches", func() bool { return strings.Contains(cl.daemon.Output(), "msg=Started") })
	return cl
}

// deployKubeconfig writes the kubeconfig of docs/deploy's ConfigMap, as the
// cluster holds it, for a daemon reaching the API server at server: the
// placeholder address filled in as the docs say, the service account's
// token file, and (the lab's API server has a throwaway certificate) TLS
// verification off instead of the pod's CA file.
func (cl *clusterLab) deployKubeconfig(t *testing.T, server string) string {
	t.Helper()
	cm, err := cl.admin.CoreV1().ConfigMaps("kube-system").Get(cl.ctx, "kube-userspace-proxy", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kc := cm.Data["kubeconfig.conf"]
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	cl.tokenMu.Lock()
	err = os.WriteFile(tokenFile, []byte(cl.token), 0o600)
	cl.tokenFiles = append(cl.tokenFiles, tokenFile)
	cl.tokenMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	for old, repl := range map[string]string{
		"https://CONTROL_PLANE_ENDPOINT:6443":                                         server,
		"certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt": "insecure-skip-tls-verify: true",
		"tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token":              "tokenFile: " + tokenFile,
	} {
		if !strings.Contains(kc, old) {
			t.Fatalf("docs/deploy's kubeconfig has no %q:\n%s", old, kc)
		}
		kc = strings.ReplaceAll(kc, old, repl)
	}
	path := filepath.Join(dir, "kubeconfig.conf")
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// tokenLife is how long the daemons' tokens live; renewed at 80% of it, as
// the kubelet renews projected service account tokens.
const tokenLife = time.Hour

func (cl *clusterLab) newToken() (string, error) {
	tr, err := cl.admin.CoreV1().ServiceAccounts("kube-system").CreateToken(cl.ctx, "kube-userspace-proxy",
		&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: ptr(int64(tokenLife / time.Second))}}, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return tr.Status.Token, nil
}

// renewTokens writes a new token into every token file before the last
// expires, each file replaced by a rename (client-go rereads it), until
// the test ends.
func (cl *clusterLab) renewTokens(t *testing.T) {
	ctx, cancel := context.WithCancel(cl.ctx)
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		wait := tokenLife * 8 / 10
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
			token, err := cl.newToken()
			if err != nil {
				t.Logf("renewing the daemons' token (again in a minute): %v", err)
				wait = time.Minute
				continue
			}
			wait = tokenLife * 8 / 10
			cl.tokenMu.Lock()
			cl.token = token
			for _, f := range cl.tokenFiles {
				if err := os.WriteFile(f+".new", []byte(token), 0o600); err == nil {
					_ = os.Rename(f+".new", f)
				}
			}
			cl.tokenMu.Unlock()
		}
	}()
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func ptr[T any](v T) *T { return &v }

// hasWarningEvent says whether the Service lab/name has a Warning Event of
// reason whose message contains text.
func (cl *clusterLab) hasWarningEvent(name, reason, text string) bool {
	evs, err := cl.admin.CoreV1().Events("lab").List(cl.ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name})
	if err != nil {
		return false
	}
	for _, e := range evs.Items {
		if e.Reason == reason && e.Type == v1.EventTypeWarning && e.InvolvedObject.Kind == "Service" && strings.Contains(e.Message, text) {
			return true
		}
	}
	return false
}

// applyDeployManifests creates the RBAC objects of docs/deploy for real and
// the DaemonSet with a server-side dry run: all must be valid.
func (cl *clusterLab) applyDeployManifests(t *testing.T) {
	t.Helper()
	for _, f := range []string{"rbac.yaml", "daemonset.yaml"} {
		data, err := os.ReadFile(filepath.Join(repoRoot, "docs", "deploy", f))
		if err != nil {
			t.Fatal(err)
		}
		r := utilyaml.NewYAMLReader(bufioReader(data))
		for {
			doc, err := r.Read()
			if err != nil {
				break
			}
			obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
			switch o := obj.(type) {
			case *v1.ServiceAccount:
				_, err = cl.admin.CoreV1().ServiceAccounts(o.Namespace).Create(cl.ctx, o, metav1.CreateOptions{})
			case *rbacv1.ClusterRole:
				_, err = cl.admin.RbacV1().ClusterRoles().Create(cl.ctx, o, metav1.CreateOptions{})
			case *rbacv1.ClusterRoleBinding:
				_, err = cl.admin.RbacV1().ClusterRoleBindings().Create(cl.ctx, o, metav1.CreateOptions{})
			case *v1.ConfigMap:
				_, err = cl.admin.CoreV1().ConfigMaps(o.Namespace).Create(cl.ctx, o, metav1.CreateOptions{})
			case *appsv1.DaemonSet:
				_, err = cl.admin.AppsV1().DaemonSets(o.Namespace).Create(cl.ctx, o, dry)
			default:
				t.Fatalf("%s: unexpected %T", f, obj)
			}
			if err != nil {
				t.Fatalf("%s: applying %T: %v", f, obj, err)
			}
		}
	}
}

func (cl *clusterLab) mustCreate(t *testing.T, obj any) {
	t.Helper()
	var err error
	switch o := obj.(type) {
	case *v1.Namespace:
		_, err = cl.admin.CoreV1().Namespaces().Create(cl.ctx, o, metav1.CreateOptions{})
	case *v1.ServiceAccount:
		_, err = cl.admin.CoreV1().ServiceAccounts(o.Namespace).Create(cl.ctx, o, metav1.CreateOptions{})
	case *v1.Node:
		_, err = cl.admin.CoreV1().Nodes().Create(cl.ctx, o, metav1.CreateOptions{})
	case *v1.Service:
		_, err = cl.admin.CoreV1().Services(o.Namespace).Create(cl.ctx, o, metav1.CreateOptions{})
	case *discovery.EndpointSlice:
		_, err = cl.admin.DiscoveryV1().EndpointSlices(o.Namespace).Create(cl.ctx, o, metav1.CreateOptions{})
	default:
		t.Fatalf("mustCreate: %T", obj)
	}
	if err != nil {
		t.Fatalf("create %T: %v", obj, err)
	}
}

// pod creates a Pod on node with the lab address ip and marks it Ready.
func (cl *clusterLab) pod(t *testing.T, name, ip, node, app string) {
	t.Helper()
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "lab", Labels: map[string]string{"app": app}},
		Spec: v1.PodSpec{NodeName: node, Containers: []v1.Container{{Name: "c", Image: "backend",
			Ports: []v1.ContainerPort{{Name: "http", ContainerPort: 8080}}}}},
	}
	if _, err := cl.admin.CoreV1().Pods("lab").Create(cl.ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cl.setReady(t, name, ip, true)
}

func (cl *clusterLab) setReady(t *testing.T, name, ip string, ready bool) {
	t.Helper()
	status := v1.ConditionFalse
	if ready {
		status = v1.ConditionTrue
	}
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{
		"phase": "Running", "podIP": ip, "podIPs": []map[string]string{{"ip": ip}},
		"conditions": []map[string]any{{"type": "Ready", "status": status}},
	}})
	if _, err := cl.admin.CoreV1().Pods("lab").Patch(cl.ctx, name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}
}

func (cl *clusterLab) service(t *testing.T, svc *v1.Service) {
	t.Helper()
	svc.Namespace = "lab"
	cl.mustCreate(t, svc)
}

func (cl *clusterLab) updateService(t *testing.T, name string, mutate func(*v1.Service)) {
	t.Helper()
	svc, err := cl.admin.CoreV1().Services("lab").Get(cl.ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	mutate(svc)
	if _, err := cl.admin.CoreV1().Services("lab").Update(cl.ctx, svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func webService(name, ip string) *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.ServiceSpec{
			ClusterIP: ip, Selector: map[string]string{"app": name},
			Ports: []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		},
	}
}

// answers fetches url from ns several times and returns the set of pods.
func (cl *clusterLab) answers(ns, url string, n int) map[string]int {
	seen := map[string]int{}
	for i := 0; i < n; i++ {
		if f := strings.Fields(cl.Curl(ns, url)); len(f) > 0 {
			seen[f[0]]++
		} else {
			seen[""]++
		}
	}
	return seen
}

// expectPods waits until n requests all reach exactly the pods in want
// (none: every request fails).
func (cl *clusterLab) expectPods(t *testing.T, ns, url string, want ...string) {
	t.Helper()
	wantSet := map[string]bool{}
	for _, w := range want {
		wantSet[w] = true
	}
	if len(want) == 0 {
		wantSet[""] = true
	}
	var last map[string]int
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := cl.answers(ns, url, 2*len(wantSet)+2)
		ok := len(got) == len(wantSet)
		for p := range got {
			ok = ok && wantSet[p]
		}
		if ok {
			return
		}
		last = got
		if time.Now().After(deadline) {
			t.Fatalf("%s → %s: reached %v, want exactly %v", ns, url, last, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestClusterSource(t *testing.T) {
	cl := newClusterLab(t)

	t.Run("selector and ready pods", func(t *testing.T) {
		cl.service(t, webService("web", "10.96.1.10"))
		cl.pod(t, "web-1", "10.251.19.12", "node", "web")
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1")
	})
	t.Run("scale 1 to 3 and back", func(t *testing.T) {
		cl.pod(t, "web-2", "10.251.19.8", "node", "web")
		cl.pod(t, "web-3", "10.251.19.20", "node", "web")
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1", "pod2", "pod3")
		for _, p := range []string{"web-2", "web-3"} {
			if err := cl.admin.CoreV1().Pods("lab").Delete(cl.ctx, p, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}); err != nil {
				t.Fatal(err)
			}
		}
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1")
	})
	t.Run("unready pod gets no new connections", func(t *testing.T) {
		cl.pod(t, "web-2", "10.251.19.8", "node", "web")
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1", "pod2")
		cl.setReady(t, "web-2", "10.251.19.8", false)
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1")
		cl.setReady(t, "web-2", "10.251.19.8", true)
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1", "pod2")
	})
	t.Run("terminating pod used only when nothing is ready", func(t *testing.T) {
		// No kubelet: a graceful delete leaves the pod Terminating.
		if err := cl.admin.CoreV1().Pods("lab").Delete(cl.ctx, "web-2", metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(3600))}); err != nil {
			t.Fatal(err)
		}
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1")
		cl.setReady(t, "web-1", "10.251.19.12", false)
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod2")
		cl.setReady(t, "web-1", "10.251.19.12", true)
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1")
	})
	t.Run("ClusterIP to NodePort", func(t *testing.T) {
		cl.updateService(t, "web", func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeNodePort
			s.Spec.Ports[0].NodePort = 31500
		})
		cl.expectPods(t, "ext", "http://192.168.50.1:31500/", "pod1")
		cl.expectPods(t, "client", "http://10.96.1.10/", "pod1")
	})
	t.Run("port change", func(t *testing.T) {
		cl.updateService(t, "web", func(s *v1.Service) { s.Spec.Ports[0].Port = 8081 })
		cl.expectPods(t, "client", "http://10.96.1.10:8081/", "pod1")
		cl.expectPods(t, "client", "http://10.96.1.10:80/")
	})
	t.Run("session affinity on and off", func(t *testing.T) {
		cl.pod(t, "web-3", "10.251.19.8", "node", "web")
		cl.expectPods(t, "client", "http://10.96.1.10:8081/", "pod1", "pod2")
		cl.updateService(t, "web", func(s *v1.Service) { s.Spec.SessionAffinity = v1.ServiceAffinityClientIP })
		waitFor(t, "affinity", func() bool {
			return len(cl.answers("client", "http://10.96.1.10:8081/", 6)) == 1
		})
		cl.updateService(t, "web", func(s *v1.Service) {
			s.Spec.SessionAffinity = v1.ServiceAffinityNone
			s.Spec.SessionAffinityConfig = nil
		})
		cl.expectPods(t, "client", "http://10.96.1.10:8081/", "pod1", "pod2")
	})
	t.Run("ignored services", func(t *testing.T) {
		other := webService("other", "10.96.1.20")
		other.Labels = map[string]string{"service.kubernetes.io/service-proxy-name": "someone-else"}
		other.Spec.Selector = map[string]string{"app": "web"}
		cl.service(t, other)
		headless := webService("headless", v1.ClusterIPNone)
		headless.Spec.Selector = map[string]string{"app": "web"}
		cl.service(t, headless)
		cl.service(t, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "ext"},
			Spec: v1.ServiceSpec{Type: v1.ServiceTypeExternalName, ExternalName: "example.com"}})
		control := webService("control", "10.96.1.21")
		control.Spec.Selector = map[string]string{"app": "web"}
		cl.service(t, control)
		cl.expectPods(t, "client", "http://10.96.1.21/", "pod1", "pod2") // the daemon saw the newest one
		if body := cl.Curl("client", "http://10.96.1.20/"); body != "" {
			t.Fatalf("service labelled for another proxy answered: %q", body)
		}
		if n := countRules(t, cl.Lab, `lab/(other|headless|ext)`); n != 0 {
			t.Fatalf("%d rules for ignored services", n)
		}
	})
	t.Run("traffic policies Local", func(t *testing.T) {
		cl.pod(t, "loc-here", "10.251.19.12", "node", "loc")
		cl.pod(t, "loc-there", "10.251.19.8", "node-b", "loc")
		loc := webService("loc", "10.96.1.30")
		loc.Spec.Type = v1.ServiceTypeNodePort
		loc.Spec.Ports[0].NodePort = 31600
		cl.service(t, loc)
		cl.expectPods(t, "client", "http://10.96.1.30/", "pod1", "pod2")
		cl.expectPods(t, "ext", "http://192.168.50.1:31600/", "pod1", "pod2")

		cl.updateService(t, "loc", func(s *v1.Service) { s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal })
		cl.expectPods(t, "ext", "http://192.168.50.1:31600/", "pod1")
		cl.expectPods(t, "client", "http://10.96.1.30/", "pod1", "pod2")

		local := v1.ServiceInternalTrafficPolicyLocal
		cl.updateService(t, "loc", func(s *v1.Service) { s.Spec.InternalTrafficPolicy = &local })
		cl.expectPods(t, "client", "http://10.96.1.30/", "pod1")

		// No local endpoint left: refused, never sent to node-b's pod.
		cl.setReady(t, "loc-here", "10.251.19.12", false)
		cl.expectPods(t, "client", "http://10.96.1.30/")
		cl.expectPods(t, "ext", "http://192.168.50.1:31600/")
	})
	t.Run("selector-less service with hand-made slice", func(t *testing.T) {
		manual := &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "manual"},
			Spec: v1.ServiceSpec{ClusterIP: "10.96.1.40", Ports: []v1.ServicePort{{Name: "http", Port: 80}}}}
		cl.service(t, manual)
		cl.mustCreate(t, &discovery.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: "manual-1", Namespace: "lab", Labels: map[string]string{discovery.LabelServiceName: "manual"}},
			AddressType: discovery.AddressTypeIPv4,
			Ports:       []discovery.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8080))}},
			Endpoints:   []discovery.Endpoint{{Addresses: []string{"10.251.19.20"}}},
		})
		cl.expectPods(t, "client", "http://10.96.1.40/", "pod3")
	})
	t.Run("NodePort held by another process: an Event, then taken back", func(t *testing.T) {
		holder := cl.Start("node", "nc", "-l", "-k", "31677")
		waitFor(t, "nc listening", func() bool {
			out, _ := cl.Exec("node", "ss", "-ltn", "sport = :31677")
			return strings.Contains(out, "LISTEN")
		})
		svc := webService("conflict", "10.96.1.50")
		svc.Spec.Selector = map[string]string{"app": "web"}
		svc.Spec.Type = v1.ServiceTypeNodePort
		svc.Spec.Ports[0].NodePort = 31677
		cl.service(t, svc)
		waitFor(t, "the ClusterIP served", func() bool { return strings.HasPrefix(cl.Curl("client", "http://10.96.1.50/"), "pod") })
		waitFor(t, "a NodePortConflict Event on the Service", func() bool { return cl.hasWarningEvent("conflict", "NodePortConflict", "31677") })
		_ = holder.Cmd.Process.Kill()
		_ = holder.Cmd.Wait()
		testutil.WaitFor(t, "the NodePort taken back", 40*time.Second, 100*time.Millisecond, func() bool {
			return strings.HasPrefix(cl.Curl("ext", "http://192.168.50.1:31677/"), "pod")
		})
	})
	t.Run("SCTP port: a Warning Event and a log line, the TCP port served", func(t *testing.T) {
		svc := webService("mixed", "10.96.1.60")
		svc.Spec.Selector = map[string]string{"app": "web"}
		svc.Spec.Ports[0].Name = "http"
		svc.Spec.Ports = append(svc.Spec.Ports, v1.ServicePort{Name: "assoc", Port: 9999, Protocol: v1.ProtocolSCTP})
		cl.service(t, svc)
		waitFor(t, "the TCP port served", func() bool { return strings.HasPrefix(cl.Curl("client", "http://10.96.1.60/"), "pod") })
		waitFor(t, "a ProtocolNotProxied Event naming the SCTP port", func() bool {
			return cl.hasWarningEvent("mixed", "ProtocolNotProxied", "assoc 9999/SCTP")
		})
		if !strings.Contains(cl.daemon.Output(), "service=lab/mixed") || strings.Count(cl.daemon.Output(), "SCTP is not proxied") != 1 {
			t.Errorf("want one warning line naming lab/mixed:\n%s", cl.daemon.Output())
		}
	})
	// Checked before the outage: a restarting kube-apiserver answers
	// "forbidden" for a moment until its RBAC caches have synced.
	if strings.Contains(cl.daemon.Output(), "forbidden") {
		t.Fatalf("the shipped ClusterRole lacks a permission the daemon used:\n%s", cl.daemon.Output())
	}
	t.Run("API server outage", func(t *testing.T) {
		cl.StopAPIServerFor(t, 30*time.Second, func() {
			// Traffic keeps flowing on the last known state.
			cl.expectPods(t, "client", "http://10.96.1.40/", "pod3")
		})
		// A change made once it is back is applied.
		cl.updateService(t, "manual", func(s *v1.Service) { s.Spec.Ports[0].Port = 8082 })
		cl.expectPods(t, "client", "http://10.96.1.40:8082/", "pod3")
		out := cl.daemon.Output()
		if n := strings.Count(out, "API server unreachable"); n != 1 {
			t.Fatalf("outage logged %d times, want once", n)
		}
		if !strings.Contains(out, "API server reachable again") {
			t.Fatal("the API server's return was not logged")
		}
	})
}

// StopAPIServerFor stops kube-apiserver, runs during every few seconds for d,
// and starts it again.
func (cl *clusterLab) StopAPIServerFor(t *testing.T, d time.Duration, during func()) {
	t.Helper()
	cl.cp.StopAPIServer()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		during()
		time.Sleep(2 * time.Second)
	}
	waitFor(t, "the outage to be logged", func() bool { return strings.Contains(cl.daemon.Output(), "API server unreachable") })
	if err := cl.cp.StartAPIServer(cl.ctx); err != nil {
		t.Fatal(err)
	}
}

func bufioReader(data []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(data)) }
