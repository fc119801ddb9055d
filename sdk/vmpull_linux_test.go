package sdk_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/layer"
	lremote "github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// TestVMImagesFromTheRemote: a worker boots the VM images its shared
// remote holds and its store does not. The first create that names one
// pulls it (each image here has no agent, so the backend then refuses
// it, before anything boots), and creates that name it at once share
// that pull. A tenant names the admin's VM image and its own published
// snapshots of full VMs, in a create and a branch; another tenant's
// snapshot and the admin's are no more there for it than a name that
// names nothing, and nothing of them is pulled.
func TestVMImagesFromTheRemote(t *testing.T) {
	ctx := context.Background()
	shared, scratch, root, certs := t.TempDir(), t.TempDir(), t.TempDir(), t.TempDir()
	if err := auth.MakeCerts(certs, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	w, local := setupAt(t, root, runtimetest.Config{Listen: []string{"tcp://" + addr}, RemoteURL: "dir://" + shared,
		TLS: worker.TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}})
	ids, c := map[string]string{}, map[string]*sdk.Client{}
	for _, party := range []string{"a", "b"} {
		secret, tok, err := auth.Open(root).New(auth.Spec{Scope: auth.Sandboxes})
		if err != nil {
			t.Fatal(err)
		}
		ids[party], c[party] = tok.ID, remote(t, addr, certs, secret, false)
	}
	mine := func(tag string) string { return "tenants/" + ids["a"] + "/" + tag }

	// What other workers pushed to the remote: the admin's VM image, two
	// of A's snapshots and one of the admin's.
	image := vm.Record{Created: time.Now().UTC(), Disk: vm.Disk{Size: 1 << 20}}
	snapshot := image
	snapshot.Sandbox, snapshot.Parent = "a VM", "r-vm:1"
	dst, err := lremote.Open("dir://"+shared, lremote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for tag, rec := range map[string]vm.Record{"r-vm:1": image, mine("a-rvm:1"): snapshot, mine("a-rvm:2"): snapshot, "adm-rvm:1": snapshot} {
		vmImage(t, scratch, tag, rec)
		ref, err := layer.ParseRef(tag)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := vm.Copy(ctx, lremote.Local(mustStore(t, scratch)), dst, ref, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	held := func(tag string) bool {
		_, err := vm.Lookup(ctx, mustStore(t, root), tag)
		return err == nil
	}
	create := func(c *sdk.Client, ref string) error {
		_, err := c.Create(ctx, api.SandboxSpec{Backend: vms.VM, Layers: []string{ref}})
		return err
	}
	branch := func(c *sdk.Client, ref string) error {
		_, err := c.Branch(ctx, api.BranchRequest{Snapshot: ref, N: 1})
		return err
	}
	pulledThenRefused := func(what string, err error, tag string) {
		t.Helper()
		if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "has no dsec agent") {
			t.Errorf("%s: %v, want the backend's refusal of an image without an agent", what, err)
		}
		if !held(tag) {
			t.Errorf("%s: %s is not in the worker's store", what, tag)
		}
	}

	// B, on A's snapshot by each name and on the admin's snapshot.
	for _, r := range []struct{ what, ref, fake string }{
		{"a's VM snapshot", "a-rvm:1", "zz-rvm:1"},
		{"a's VM snapshot in its namespace", mine("a-rvm:1"), mine("zz-rvm:1")},
		{"the admin's VM snapshot", "adm-rvm:1", "zz-rvm:1"},
	} {
		sameAnswer(t, "create on "+r.what, create(c["b"], r.ref), create(c["b"], r.fake), r.ref, r.fake)
		sameAnswer(t, "branch of "+r.what, branch(c["b"], r.ref), branch(c["b"], r.fake), r.ref, r.fake)
	}
	for _, tag := range []string{mine("a-rvm:1"), "adm-rvm:1"} {
		if held(tag) {
			t.Errorf("%s was pulled for a tenant who may not name it", tag)
		}
	}

	// A, on its own snapshot, and on its other one in a branch.
	pulledThenRefused("a's create on its snapshot", create(c["a"], "a-rvm:1"), mine("a-rvm:1"))
	pulledThenRefused("a's branch of its snapshot", branch(c["a"], "a-rvm:2"), mine("a-rvm:2"))
	// Two creates at once on the admin's VM image: one pull.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Go(func() { errs[i] = create(c["a"], "r-vm:1") })
	}
	wg.Wait()
	for i, err := range errs {
		pulledThenRefused("a's create on the admin's VM image, "+string(rune('1'+i)), err, "r-vm:1")
	}
	// The admin, on the socket: its snapshot.
	pulledThenRefused("the admin's create on its snapshot", create(local, "adm-rvm:1"), "adm-rvm:1")

	log, err := os.ReadFile(filepath.Join(w.Root, "worker.log"))
	if err != nil {
		t.Fatal(err)
	}
	pulls := 0
	for _, l := range strings.Split(string(log), "\n") {
		if strings.Contains(l, "pulled VM image") && strings.Contains(l, "image=r-vm:1 ") {
			pulls++
		}
	}
	if pulls != 1 {
		t.Errorf("the admin's VM image was pulled %d times, want once", pulls)
	}
}
