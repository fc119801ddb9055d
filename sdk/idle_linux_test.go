package sdk_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

func sdkExec(id, script string) sdk.ExecOptions {
	return sdk.ExecOptions{ID: id, Args: []string{"sh", "-c", script}}
}

// TestIdleHint: a sandbox hinted to wait long enough is frozen (a
// counter its process writes stops) and its page cache given back,
// while it shows running; its next exec resumes it first and runs; a
// hint of a short wait does nothing; a pause of a hinted sandbox pauses
// it for good.
func TestIdleHint(t *testing.T) {
	ctx := context.Background()
	_, c := setup(t)
	sb := create(t, c, api.SandboxSpec{Name: "idle"})
	run(t, sb, "fill", "dd if=/dev/urandom of=/work/big bs=1M count=32 2>/dev/null && cat /work/big > /dev/null")
	if _, err := sb.Exec(ctx, sdkExec("counter", "(i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.02; done) >/dev/null 2>&1 &")); err != nil {
		t.Fatal(err)
	}
	counter := func() string {
		var b bytes.Buffer
		if err := sb.ReadFile(ctx, "/tmp/c", &b); err != nil {
			t.Fatal(err)
		}
		return b.String()
	}
	// The counter must have written once before the hint freezes it: on a
	// loaded host its shell can take longer than any fixed sleep to start.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var b bytes.Buffer
		if err := sb.ReadFile(ctx, "/tmp/c", &b); err == nil && b.Len() > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the counter wrote nothing in 10 s")
		}
	}

	short, err := sb.Idle(ctx, 500*time.Millisecond)
	if err != nil || short.Frozen {
		t.Fatalf("a hint of half a second: %+v %v, want nothing done", short, err)
	}
	rep, err := sb.Idle(ctx, time.Minute)
	if err != nil || !rep.Frozen {
		t.Fatalf("a hint of a minute: %+v %v", rep, err)
	}
	if rep.MemoryAfter > rep.MemoryBefore-16<<20 {
		t.Errorf("the hint gave back %d of %d bytes, want the 32 MiB file's page cache", rep.MemoryBefore-rep.MemoryAfter, rep.MemoryBefore)
	}
	info, err := sb.Inspect(ctx)
	if err != nil || info.Status != api.StatusRunning || !info.Hinted {
		t.Errorf("a hinted sandbox: %s hinted %v (%v), want running and hinted", info.Status, info.Hinted, err)
	}
	at := counter()
	time.Sleep(200 * time.Millisecond)
	if now := counter(); now != at {
		t.Errorf("the counter ran on while hinted: %q then %q", at, now)
	}
	if out, res := run(t, sb, "next", "echo turn"); out != "turn\n" || res.ExitCode != 0 {
		t.Fatalf("the next exec: %q %+v", out, res)
	}
	time.Sleep(100 * time.Millisecond)
	if now := counter(); now == at {
		t.Errorf("the counter stands after the exec that resumed it: %q", now)
	}
	if info, _ := sb.Inspect(ctx); info.Hinted {
		t.Error("still hinted after an exec")
	}

	// A pause of a hinted sandbox: paused, no exec resumes it.
	if _, err := sb.Idle(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := sb.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if info, _ := sb.Inspect(ctx); info.Status != api.StatusPaused || info.Hinted {
		t.Errorf("paused after a hint: %s hinted %v", info.Status, info.Hinted)
	}
	if _, err := sb.Exec(ctx, sdkExec("refused", "true")); err == nil {
		t.Error("an exec ran in a paused sandbox")
	}
	if err := sb.Resume(ctx); err != nil {
		t.Fatal(err)
	}
}
