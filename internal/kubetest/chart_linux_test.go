package kubetest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/kubetest"
	"github.com/dsec-project/dsec/sdk"
)

// deployDir is the repository's deploy/ directory.
func deployDir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "deploy")
}

// TestChart: the Helm chart with its default values renders the objects
// the kustomize base does, field for field (the base's Namespace aside:
// helm install --create-namespace makes it), so the two never drift.
func TestChart(t *testing.T) {
	bin := kubetest.Tools(t)
	render := func(name string, args ...string) map[string]map[string]any {
		t.Helper()
		cmd := exec.Command(filepath.Join(bin, name), args...)
		cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, errb.String())
		}
		objs := map[string]map[string]any{}
		for _, doc := range strings.Split(out.String(), "\n---") {
			var o map[string]any
			if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
				t.Fatalf("%s's output: %v", name, err)
			}
			if o == nil {
				continue
			}
			md, _ := o["metadata"].(map[string]any)
			objs[fmt.Sprintf("%s %v/%v", o["kind"], md["namespace"], md["name"])] = o
		}
		return objs
	}
	chart := render("helm", "template", "dsec", filepath.Join(deployDir(), "helm", "dsec"), "--namespace", "dsec", "--include-crds")
	base := render("kubectl", "kustomize", filepath.Join(deployDir(), "kubernetes", "base"))
	delete(base, "Namespace <nil>/dsec")
	if len(chart) != len(base) {
		t.Errorf("the chart renders %d objects, the base %d", len(chart), len(base))
	}
	for k, b := range base {
		c, ok := chart[k]
		if !ok {
			t.Errorf("the chart lacks the base's %s", k)
			continue
		}
		if !reflect.DeepEqual(b, c) {
			bj, _ := json.MarshalIndent(b, "", " ")
			cj, _ := json.MarshalIndent(c, "", " ")
			t.Errorf("%s differs:\nbase:  %s\nchart: %s", k, bj, cj)
		}
	}
}

// TestHelmInstall installs the chart on a real cluster of two nodes, as
// the README says, with the values such a cluster needs (its gateway on
// its node's network, the API server by address, images only as
// imported): the workers and both gateway replicas come up, a sandbox
// made through a gateway runs, it lives on through helm upgrade (every
// pod replaced), and helm uninstall takes dsec's pods away.
func TestHelmInstall(t *testing.T) {
	f := startFleet(t)
	c, ctx := f.c, context.Background()
	values := fmt.Sprintf(`image: {pullPolicy: Never}
worker: {root: %s}
gateway:
  hostNetwork: true
  args: ["--heartbeat=1s"]
  env:
    - {name: KUBERNETES_SERVICE_HOST, value: %q}
    - {name: KUBERNETES_SERVICE_PORT, value: "6443"}
`, f.roots, kubetest.HostIP)
	vf := filepath.Join(c.Dir, "values.yaml")
	if err := os.WriteFile(vf, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	chart := filepath.Join(deployDir(), "helm", "dsec")
	t0 := time.Now()
	if out, err := c.Helm("install", "dsec", chart, "-n", "dsec", "-f", vf); err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	undeploy(t, c)
	ready := func(what string) {
		t.Helper()
		c.WaitFor(3*time.Minute, what, func() bool {
			ds, err1 := c.Kubectl("-n", "dsec", "get", "daemonset", "dsec-worker", "-o",
				"jsonpath={.status.numberReady}/{.status.updatedNumberScheduled}/{.status.desiredNumberScheduled}")
			gw, err2 := c.Kubectl("-n", "dsec", "get", "deployment", "dsec-gateway", "-o",
				"jsonpath={.status.availableReplicas}/{.status.updatedReplicas}/{.status.replicas}")
			return err1 == nil && err2 == nil && ds == "2/2/2" && gw == "2/2/2"
		})
	}
	ready("the chart's workers and gateways ready")
	t.Logf("helm install to both workers and both gateways ready: %s", time.Since(t0).Round(100*time.Millisecond))
	ip := strings.Fields(c.MustKubectl("-n", "dsec", "get", "pod", "-l", "app.kubernetes.io/component=gateway", "-o", "jsonpath={.items[*].status.hostIP}"))[0]
	gw, err := sdk.New(sdk.Options{Host: "tcp://" + ip + ":7444", Token: f.gatewayToken, TLSCA: filepath.Join(f.certs, auth.CAFile)})
	if err != nil {
		t.Fatal(err)
	}
	c.WaitFor(time.Minute, "the gateway's fleet: both workers, up", func() bool {
		ns, err := gw.Nodes(ctx)
		return err == nil && len(ns) == 2 && ns[0].Up && ns[1].Up
	})
	sb, err := gw.Create(ctx, api.SandboxSpec{Name: "h0", Layers: []string{"ws:1", "bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	if out := run(t, sb, "echo kept > /state; cat /state"); out != "kept\n" {
		t.Fatalf("h0: %q", out)
	}

	// An upgrade that changes the pods' spec replaces every one.
	before := c.MustKubectl("-n", "dsec", "get", "pods", "-o", "jsonpath={.items[*].metadata.uid}")
	if out, err := c.Helm("upgrade", "dsec", chart, "-n", "dsec", "-f", vf, "--set", "logLevel=debug"); err != nil {
		t.Fatalf("helm upgrade: %v\n%s", err, out)
	}
	c.WaitFor(3*time.Minute, "every pod replaced", func() bool {
		now, err := c.Kubectl("-n", "dsec", "get", "pods", "-o", "jsonpath={.items[*].metadata.uid}")
		for _, uid := range strings.Fields(before) {
			if err != nil || strings.Contains(now, uid) {
				return false
			}
		}
		return len(strings.Fields(now)) == 4
	})
	ready("the upgraded pods ready")
	var out string
	c.WaitFor(time.Minute, "h0 served after the upgrade", func() bool {
		out, err = tryRun(sb, "cat /state")
		return err == nil
	})
	if out != "kept\n" {
		t.Errorf("h0 after the upgrade: %q", out)
	}

	if out, err := c.Helm("uninstall", "dsec", "-n", "dsec", "--wait"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	c.WaitFor(2*time.Minute, "dsec's pods gone", func() bool {
		out, err := c.Kubectl("-n", "dsec", "get", "pods", "-o", "name")
		return err == nil && strings.TrimSpace(out) == ""
	})
}
