package sdk_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
)

// TestSpares: the worker keeps inits started ahead of need; a latency
// sandbox takes one (init and group), a batch one starts its own, the
// worker refills. The spares die with their worker (kill -9 included) and
// the next worker removes their groups but for those sandboxes took.
func TestSpares(t *testing.T) {
	cfg := runtimetest.Config{Admission: worker.Admission{Spares: 2}}
	w, c := setupWith(t, cfg)
	ctx := context.Background()
	waitFor(t, "two spares", func() bool { return len(w.Spares()) == 2 })
	spares := w.Spares()
	spareGroups, _ := runtime.Groups(nil, w.Root) // no sandbox yet: the spares'

	sb := create(t, c, api.SandboxSpec{Name: "fast"})
	info, err := sb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(spares, strconv.Itoa(info.Pid)) || !slices.Contains(spareGroups, lastElem(info.Cgroup)) || lastElem(info.Cgroup) != "sb-"+info.ID+runtime.CgroupSuffix(w.Root) {
		t.Fatalf("the sandbox's init %d in %s, not one of the spares %v", info.Pid, info.Cgroup, spares)
	}
	if out, res := run(t, sb, "facts", "hostname; cat /etc/answer /work/hello; echo $$ > /tmp/state; grep -c : /proc/net/dev"); res.ExitCode != 0 || out != "fast\n42\nfrom the workspace\n1\n" {
		t.Fatalf("in a sandbox made from a spare: %q %+v", out, res)
	}
	batch := create(t, c, api.SandboxSpec{Name: "slow", Class: api.SchedBatch})
	binfo, _ := batch.Inspect(ctx)
	if slices.Contains(spareGroups, lastElem(binfo.Cgroup)) || slices.Contains(spares, strconv.Itoa(binfo.Pid)) {
		t.Fatalf("a batch sandbox took a spare: %s", binfo.Cgroup)
	}
	waitFor(t, "the spares refilled", func() bool { return len(w.Spares()) == 2 })

	// Killed, the worker takes its spares along; the next one sweeps
	// their groups, keeps the sandbox's and makes new spares.
	left := w.Spares()
	w.Kill()
	waitFor(t, "the spares to exit", func() bool {
		for _, pid := range left {
			if p, _ := strconv.Atoi(pid); unix.Kill(p, 0) == nil {
				return false
			}
		}
		return true
	})
	w = runtimetest.StartWorkerWith(t, w.Root, cfg)
	waitFor(t, "two new spares", func() bool { return len(w.Spares()) == 2 })
	groups, err := runtime.Groups(nil, w.Root)
	if err != nil || len(groups) != 4 || !slices.Contains(groups, lastElem(info.Cgroup)) || !slices.Contains(groups, lastElem(binfo.Cgroup)) {
		t.Fatalf("after a restart the groups are %v (%v): want two new spares' and the sandboxes' %s and %s", groups, err, info.Cgroup, binfo.Cgroup)
	}
	if out, _ := run(t, sb, "after", "cat /tmp/state"); strings.TrimSpace(out) == "" {
		t.Fatal("the sandbox lost its state over the restart")
	}
	if err := sb.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	if groups, _ := runtime.Groups(nil, w.Root); slices.Contains(groups, lastElem(info.Cgroup)) {
		t.Fatalf("the removed sandbox's group stays: %v", groups)
	}
}

// TestWithoutSpares: a worker told to keep none starts every init at
// the create. (Nothing primed either: the sandbox primed after the
// create starts an init of its own, which a loaded host may show
// before the check.)
func TestWithoutSpares(t *testing.T) {
	w, c := setupWith(t, runtimetest.Config{Admission: worker.Admission{Spares: -1, Primed: -1}})
	sb := create(t, c, api.SandboxSpec{Name: "cold"})
	info, _ := sb.Inspect(context.Background())
	if groups, _ := runtime.Groups(nil, w.Root); len(groups) != 1 || len(w.Spares()) != 0 {
		t.Fatalf("spares without spares: %s, %v", info.Cgroup, w.Spares())
	}
	if out, res := run(t, sb, "x", "cat /etc/answer"); out != "42\n" {
		t.Fatalf("%q %+v", out, res)
	}
}

func lastElem(p string) string { return p[strings.LastIndex(p, "/")+1:] }
