package sdk_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/backend/backendtest"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestContainerBackend holds the container backend to the conformance
// suite every backend passes.
func TestContainerBackend(t *testing.T) {
	backendtest.Run(t, conformance("container", runtimetest.Config{}))
}

// TestMicroVMBackend holds the microvm backend to the same suite: QEMU
// guests, under TCG on these machines (KVM where the host has it).
func TestMicroVMBackend(t *testing.T) {
	backendtest.Run(t, conformance("microvm", runtimetest.Config{MicroVM: microvmtest.Settings(t)}))
}

// TestPlainBackend holds a backend of this test's own (plainDriver),
// registered with the worker from outside package runtime, to the same
// suite: the driver seam is all a backend needs.
func TestPlainBackend(t *testing.T) {
	backendtest.Run(t, conformance("plain", runtimetest.Config{Drivers: []string{"plain"}}))
}

// conformance makes the suite's Envs: workers of cfg on fresh roots,
// their sandboxes on backend b.
func conformance(b string, cfg runtimetest.Config) backendtest.Factory {
	return func(t *testing.T) *backendtest.Env {
		w, c := setupWith(t, cfg)
		return &backendtest.Env{
			Backend: b,
			Layers:  []string{"ws:1", "bb:1"},
			Client:  c,
			Restart: func(t *testing.T) *sdk.Client {
				w.Kill()
				w = runtimetest.StartWorkerWith(t, w.Root, cfg)
				c, err := sdk.New(sdk.Options{Root: w.Root})
				if err != nil {
					t.Fatal(err)
				}
				return c
			},
			Leftovers: func() []string { return runtimetest.Leftovers(w.Root) },
			Root:      w.Root,
		}
	}
}

// TestFeatures: what the worker reports of the host matches what its
// sandboxes meet: a sandbox's own group has cgroup.kill and
// cgroup.freeze exactly when they are reported, the memory controller
// is on cgroup2 exactly when that is, and every missing feature says
// why and what dsec does without it.
func TestFeatures(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	v, err := c.Version(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]api.Feature{}
	for _, f := range v.Features {
		got[f.Name] = f
		if !f.Available && (f.Reason == "" || f.Without == "") {
			t.Errorf("missing feature %s says no reason or consequence: %+v", f.Name, f)
		}
	}
	for _, name := range []string{"erofs", "overlay", "bpf cgroup/sock_addr", "bpf cgroup/dev"} {
		if !got[name].Available { // every sandbox stands on these
			t.Errorf("%s reported missing on a host that runs sandboxes: %+v", name, got[name])
		}
	}
	sb := create(t, c, api.SandboxSpec{Name: "probe"})
	info, err := sb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for file, name := range map[string]string{"cgroup.kill": "cgroup.kill", "cgroup.freeze": "cgroup.freeze"} {
		_, err := os.Stat(filepath.Join(info.Cgroup, file))
		if has := err == nil; has != got[name].Available {
			t.Errorf("the sandbox's group %s has %s: %v; reported available: %v", info.Cgroup, file, has, got[name].Available)
		}
	}
	b, err := os.ReadFile(filepath.Join(filepath.Dir(filepath.Dir(info.Cgroup)), "cgroup.controllers"))
	if err != nil {
		t.Fatal(err)
	}
	if has := slices.Contains(strings.Fields(string(b)), "memory"); has != got["cgroup2 memory"].Available {
		t.Errorf("memory on cgroup2: %v; reported available: %v", has, got["cgroup2 memory"].Available)
	}
}
