package sdk_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// TestMicroVMTurns: a microVM between turns and at the end of a
// rollout. An idle hint squeezes the guest first (its balloon takes the
// page cache a command filled, and the host's charge for it falls),
// then freezes it; the next exec resumes it with all its memory. A
// grade reads the guest's files (its guest holds them) and runs in a
// guest of its own; a fork with its memory continues the guest.
func TestMicroVMTurns(t *testing.T) {
	w, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
	ctx := context.Background()
	grader := t.TempDir()
	os.MkdirAll(filepath.Join(grader, "opt", "grader"), 0o755)
	os.WriteFile(filepath.Join(grader, "opt", "grader", "grade"), []byte("cat /work/answer; test \"$(cat /work/answer)\" = 42\n"), 0o644)
	buildLayer(t, w.Root, "vmgrader:1", grader)

	spec := vmSpec("turns")
	spec.Memory = 256 << 20
	sb := create(t, c, spec)
	memTotal := func() int {
		out, _ := run(t, sb, "mem-"+strconv.FormatInt(time.Now().UnixNano(), 10), "grep MemTotal /proc/meminfo")
		f := strings.Fields(out)
		if len(f) < 2 {
			t.Fatalf("MemTotal: %q", out)
		}
		kb, _ := strconv.Atoi(f[1])
		return kb
	}
	full := memTotal()
	run(t, sb, "work", "echo 42 > /work/answer; dd if=/dev/urandom of=/work/cache bs=1M count=96 2>/dev/null; cat /work/cache > /dev/null; sync")
	rep, err := sb.Idle(ctx, time.Minute)
	if err != nil || !rep.Frozen {
		t.Fatalf("an idle hint: %+v %v", rep, err)
	}
	if rep.MemoryAfter > rep.MemoryBefore-48<<20 {
		t.Errorf("the hint took %d MiB of the guest's %d MiB from the host: want most of its 96 MiB of page cache", (rep.MemoryBefore-rep.MemoryAfter)>>20, rep.MemoryBefore>>20)
	}
	if now := memTotal(); now < full-8<<10 {
		t.Errorf("after the exec that resumed it the guest has %d KiB, %d before the hint", now, full)
	}

	g, err := sb.Grade(ctx, api.GradeRequest{Grader: []string{"vmgrader:1"}, Carry: []string{"/work/**", "!/work/cache"}, Args: []string{"sh", "/opt/grader/grade"}})
	if err != nil || g.ExitCode != 0 || g.Stdout != "42\n" || g.Tamper.Processes != -1 {
		t.Fatalf("a grade of a microVM: %+v %v", g, err)
	}

	grp, err := sb.Fork(ctx, api.ForkRequest{N: 1, Memory: true, TTL: 600})
	if err != nil {
		t.Fatalf("a fork of a microVM with its memory: %v", err)
	}
	if out, _ := run(t, c.Sandbox(grp.Members[0].Name), "look", "cat /work/answer"); out != "42\n" {
		t.Errorf("the fork's member: %q", out)
	}
	if _, err := c.RemoveLease(ctx, grp.Lease); err != nil {
		t.Fatal(err)
	}
}
