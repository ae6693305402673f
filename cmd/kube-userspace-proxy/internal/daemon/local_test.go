package daemon

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// --detect-local-mode and its values, as flags and as kube-proxy's config
// fields; each refusal names the setting.
func TestLocalDetectionSettings(t *testing.T) {
	for _, tc := range []struct {
		args  []string
		want  string // Describe(), or the error's text
		isErr bool
	}{
		{nil, "the node itself and no pod detected (ClusterCIDR without a value)", false},
		{[]string{"--cluster-cidr", "10.244.0.0/16,fd00:10::/56"}, "pods by ClusterCIDR (-s 10.244.0.0/16, -s fd00:10::/56)", false},
		{[]string{"--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cni0"}, "pods by BridgeInterface (-i cni0, -i cni0)", false},
		{[]string{"--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"}, "(-i veth+, -i veth+)", false},
		{[]string{"--detect-local-mode", "NodeCIDR", "--cluster-cidr", "10.244.0.0/16"}, "no pod detected (NodeCIDR without a value)", false},
		{[]string{"--detect-local-mode", "Bridge"}, `--detect-local-mode: "Bridge" is not a mode`, true},
		{[]string{"--detect-local-mode", "BridgeInterface"}, "--detect-local-mode BridgeInterface needs --pod-bridge-interface (detectLocal.bridgeInterface in --config): it is empty", true},
		{[]string{"--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "a/b"}, `"a/b" is not an interface name`, true},
		{[]string{"--cluster-cidr", "10.244.0.0/16,10.245.0.0/16"}, "at most one CIDR per IP family", true},
		{[]string{"--cluster-cidr", "10.244.0.1/16"}, "has host bits set", true},
	} {
		o, err := options.Parse(append([]string{"--manifests", "m.yaml"}, tc.args...), io.Discard)
		switch {
		case tc.isErr && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%v: error %v, want one saying %q", tc.args, err, tc.want)
		case !tc.isErr && err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case !tc.isErr && !strings.Contains(o.Local.Describe(), tc.want):
			t.Errorf("%v: %q, want %q", tc.args, o.Local.Describe(), tc.want)
		}
	}

	// kube-proxy's fields set the same, and a bad one is named by its field.
	dir := t.TempDir()
	file := filepath.Join(dir, "c.yaml")
	write := func(body string) {
		if err := os.WriteFile(file, []byte("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"+body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  bridgeInterface: \"\"\n  interfaceNamePrefix: cali\nclusterCIDR: 10.244.0.0/16\n")
	o, err := options.Parse([]string{"--manifests", "m.yaml", "--config", file}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.Local.Mode != config.LocalModeInterfaceNamePrefix || o.Local.Interface != "cali" || len(o.ConfigWarnings) != 0 {
		t.Fatalf("from the file: %+v, warnings %v", o.Local, o.ConfigWarnings)
	}
	write("detectLocalMode: BridgeInterface\n")
	if _, err := options.Parse(
		[]string{"--manifests", "m.yaml", "--config", file},
		io.Discard,
	); err == nil ||
		!strings.Contains(err.Error(), "detectLocal.bridgeInterface") {
		t.Fatalf("a BridgeInterface mode without its bridge: %v", err)
	}
}

// A daemon that may not read its Node says so at once instead of waiting
// out the pod CIDRs' five minutes (and its liveness probe).
func TestNodePodCIDRsForbiddenFailsAtOnce(t *testing.T) {
	client := fake.NewSimpleClientset()
	client.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "node1", errors.New("RBAC: no get"))
	})
	start := time.Now()
	_, err := nodePodCIDRs(context.Background(), client, "", "node1", time.Minute, logrus.New())
	if err == nil || !strings.Contains(err.Error(), "needs get on nodes") {
		t.Fatalf("error %v, want one naming the missing permission", err)
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Fatalf("took %v: it waited", took)
	}
}
