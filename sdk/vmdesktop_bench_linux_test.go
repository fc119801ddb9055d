package sdk_test

import (
	"bytes"
	"context"
	"slices"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkFullVMDesktop: a full VM of a Debian image with Xfce, started
// logged in (runtimetest.DesktopImage), as a computer-use agent has it:
// create to a settled desktop (Xorg, the window manager, the panel and
// the wallpaper up, the screen unchanged for 5 s); with a terminal
// opened by its keys, a screenshot's latency through the SDK and input
// to screen (a key typed into the terminal until a screenshot shows its
// glyph, the panel's clock left out); the host memory of the idle
// desktop, next to the RAM it was given. One desktop per round (b.N).
func BenchmarkFullVMDesktop(b *testing.B) {
	root, c := vmBenchWorker(b)
	ref := runtimetest.DesktopImage(b, root)
	ctx := context.Background()
	spec := api.SandboxSpec{Backend: vms.VM, Layers: []string{ref}, Memory: 1536 << 20, CPU: 2}
	var ready, shots, typed []time.Duration
	var idle []float64
	for b.Loop() {
		t0 := time.Now()
		sb, err := c.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		waitRunning(b, sb, "Xorg xfwm4 xfce4-panel xfdesktop")
		settledB(b, sb, 5)
		ready = append(ready, time.Since(t0))
		if err := sb.Press(ctx, "ctrl+alt+t"); err != nil {
			b.Fatal(err)
		}
		waitRunning(b, sb, "xfce4-terminal")
		settledB(b, sb, 3)
		for range 20 {
			t0 := time.Now()
			screenshotB(b, sb)
			shots = append(shots, time.Since(t0))
			time.Sleep(50 * time.Millisecond)
		}
		for _, key := range []string{"a", "b", "c", "d", "e"} {
			before, _ := screenshotB(b, sb)
			t0 := time.Now()
			if err := sb.Press(ctx, key); err != nil {
				b.Fatal(err)
			}
			for {
				now, _ := screenshotB(b, sb)
				// A glyph and the cursor moved past it: more than a cell.
				if changedWidthBelow(b, before, now, panelHeight) > 12 {
					break
				}
				if time.Since(t0) > time.Minute {
					b.Fatal("a key typed into the terminal never reached the screen")
				}
			}
			typed = append(typed, time.Since(t0))
		}
		time.Sleep(30 * time.Second)
		info, err := sb.Inspect(ctx)
		if err != nil {
			b.Fatal(err)
		}
		idle = append(idle, float64(info.MemoryBytes)/(1<<20))
		sb.Remove(ctx, true)
	}
	slices.Sort(idle)
	b.ReportMetric(p50ms(ready), "desktop-ready-p50-ms")
	b.ReportMetric(p50ms(shots), "desktop-screenshot-p50-ms")
	b.ReportMetric(p50ms(typed), "desktop-input-p50-ms")
	b.ReportMetric(idle[len(idle)/2], "desktop-idle-host-MiB")
	b.ReportMetric(float64(spec.Memory)/(1<<20), "desktop-guest-MiB")
}

// panelHeight is what the top of the desktop's screen holds of Xfce's
// panel, whose clock changes by itself.
const panelHeight = 40

// waitRunning waits until every process named in procs runs in sb.
func waitRunning(b *testing.B, sb *sdk.Sandbox, procs string) {
	b.Helper()
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(time.Second) {
		res, err := sb.Exec(context.Background(), sdk.ExecOptions{Args: []string{"sh", "-c", "for p in " + procs + "; do pgrep -x $p >/dev/null || exit 1; done"}})
		if err == nil && res.ExitCode == 0 {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("never running: %s", procs)
		}
	}
}

// settledB waits until sb's screen has not changed for secs seconds.
func settledB(b *testing.B, sb *sdk.Sandbox, secs int) {
	b.Helper()
	var last []byte
	same := 0
	for deadline := time.Now().Add(5 * time.Minute); same < secs; time.Sleep(time.Second) {
		shot, _ := screenshotB(b, sb)
		if bytes.Equal(shot, last) {
			same++
		} else {
			same = 0
		}
		last = shot
		if time.Now().After(deadline) {
			b.Fatal("the screen never settled")
		}
	}
}
