package sdk_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/backend/backendtest"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// journalBytes is what the host holds of sandbox sb's journaled output.
func journalBytes(t *testing.T, root string, sb *sdk.Sandbox) (n int64) {
	t.Helper()
	info, err := sb.Inspect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob(filepath.Join(root, "sandboxes", info.ID, "execs", "*", "std*"))
	for _, p := range files {
		if st, err := os.Stat(p); err == nil {
			n += st.Size()
		}
	}
	return n
}

// TestJournalRotation: with exec.max_output at 4 MiB and a 16 MiB disk,
// a command's output past 4 MiB is read, dropped and counted; many
// steps keep the sandbox's journal within its disk bound, the oldest
// outputs emptied (their results kept, and saying so), the newest kept
// whole; a worker that restarted counts what its predecessor left.
func TestJournalRotation(t *testing.T) {
	cfg := runtimetest.Config{MaxOutput: 4 << 20}
	w, c := setupWith(t, cfg)
	sb := create(t, c, api.SandboxSpec{Name: "rotate", Disk: 16 << 20})
	out, res := run(t, sb, "big", "head -c 5242880 /dev/zero")
	if len(out) != 4<<20 || res.ExitCode != 0 || !res.OutputTruncated || res.OutputTruncatedBytes != 1<<20 {
		t.Fatalf("5 MiB past a 4 MiB cap: %d bytes, %+v", len(out), res)
	}
	step := func(sb *sdk.Sandbox, i int) {
		t.Helper()
		out, res := run(t, sb, fmt.Sprint("s", i), "head -c 3145728 /dev/zero")
		if len(out) != 3<<20 || res.ExitCode != 0 || res.OutputTruncated {
			t.Fatalf("step %d: %d bytes, %+v", i, len(out), res)
		}
		if n := journalBytes(t, w.Root, sb); n > 16<<20 {
			t.Fatalf("after step %d the host holds %d bytes of the sandbox's journal, past its 16 MiB", i, n)
		}
	}
	for i := range 10 {
		step(sb, i)
	}
	// Before a step, at most 16-4 MiB of ended outputs: four of 3 MiB.
	w.Kill()
	w = runtimetest.StartWorkerWith(t, w.Root, cfg)
	sb = c.Sandbox(sb.Name)
	step(sb, 10)
	replay := func(id string) (int, api.ExecResult) {
		var buf bytes.Buffer
		res, err := sb.Logs(context.Background(), id, false, &buf, &buf)
		if err != nil {
			t.Fatalf("logs %s: %v", id, err)
		}
		return buf.Len(), res
	}
	for _, id := range []string{"big", "s0", "s1", "s2", "s3", "s4", "s5"} {
		if n, res := replay(id); n != 0 || !res.OutputDropped || res.ExitCode != 0 || res.ID != id {
			t.Errorf("%s's replay: %d bytes, %+v, want its output dropped, its result kept", id, n, res)
		}
	}
	for _, id := range []string{"s6", "s7", "s8", "s9", "s10"} {
		if n, res := replay(id); n != 3<<20 || res.OutputDropped {
			t.Errorf("%s's replay: %d bytes, %+v, want its 3 MiB", id, n, res)
		}
	}
	// Replayed by exec, the mark comes too.
	var buf bytes.Buffer
	res, err := sb.Exec(context.Background(), sdk.ExecOptions{ID: "big", Args: []string{"sh", "-c", "head -c 5242880 /dev/zero"}, Stdout: &buf})
	if err != nil || !res.Replayed || !res.OutputDropped || !res.OutputTruncated || buf.Len() != 0 {
		t.Errorf("the first step replayed by exec: %d bytes, %+v %v", buf.Len(), res, err)
	}
}

// TestJournalTerminal: a terminal's output is journaled by the worker
// from the master it holds, bounded by the cap (what passes counted),
// and nothing a process the step left shows on the terminal after the
// step ended is journaled; the process runs on. Both backends: a
// microVM's shim bounds what its guest sends, and drops what comes after
// the exit.
func TestJournalTerminal(t *testing.T) {
	for _, backend := range []string{"container", "microvm"} {
		t.Run(backend, func(t *testing.T) {
			cfg := runtimetest.Config{MaxOutput: 1 << 20}
			if backend == "microvm" {
				cfg.MicroVM = microvmtest.Settings(t)
			}
			_, c := setupWith(t, cfg)
			sb := create(t, c, api.SandboxSpec{Name: "tty", Backend: backend})
			ctx := context.Background()
			var out bytes.Buffer
			res, err := sb.Exec(ctx, sdk.ExecOptions{ID: "flood", Args: []string{"sh", "-c", "head -c 3145728 /dev/zero | tr '\\0' x"}, TTY: true, Stdout: &out})
			if err != nil || res.ExitCode != 0 || !res.OutputTruncated || out.Len() > 1<<20 || int64(out.Len())+res.OutputTruncatedBytes != 3<<20 {
				t.Fatalf("3 MiB on a terminal, a 1 MiB cap: %d bytes, %+v %v", out.Len(), res, err)
			}
			// The leftover (deaf to the terminal's hangup) waits for the
			// step's end, then writes for a while (until the terminal
			// hangs up, or 2000 lines).
			const forge = `trap '' HUP; echo honest; ( while [ -e /proc/$$ ]; do sleep 0.01; done; sleep 0.1; i=0; ` +
				`while [ $i -lt 2000 ]; do echo reward=1 || break; i=$((i+1)); done; touch /wrote; exec sleep 1000 ) & exit 0`
			out.Reset()
			res, err = sb.Exec(ctx, sdk.ExecOptions{ID: "forge", Args: []string{"sh", "-c", forge}, TTY: true, Stdout: &out})
			if err != nil || res.ExitCode != 0 || strings.ReplaceAll(out.String(), "\r", "") != "honest\n" {
				t.Fatalf("the step: %q %+v %v", out.String(), res, err)
			}
			backendtest.WaitFile(t, sb, "/wrote")
			out.Reset()
			if res, err := sb.Logs(ctx, "forge", false, &out, &out); err != nil || strings.ReplaceAll(out.String(), "\r", "") != "honest\n" || res.OutputTruncated {
				t.Errorf("the replay after the leftover wrote: %q %+v %v, want the step's own output", out.String(), res, err)
			}
			if got, _ := run(t, sb, "alive", "ps | grep -c '[s]leep 1000'"); got != "1\n" {
				t.Errorf("the leftover: %q running, want 1", got)
			}
		})
	}
}
