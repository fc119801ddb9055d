package sdk_test

import (
	"bufio"
	"bytes"
	"context"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkFullVM: full VMs of a Debian image (the backend vm, under the
// host's accelerator): create to first exec, booted afresh through the
// firmware, next to QEMU booting the same image by hand to its login
// prompt on the serial console (the machine alone, no dsec); a
// screenshot's latency through the SDK; input to screen (a key typed at
// the console's login prompt until a screenshot shows it); the host
// memory of an idle VM next to the RAM it was given; and the disk each
// VM of the image adds (its overlay) next to the image's; then a
// memory snapshot of the idle VM (how long it was paused, what its
// saved state holds) and create to first exec of branches that continue
// it, next to the cold boots. Rounds: b.N (make bench: BENCH_VM_N).
func BenchmarkFullVM(b *testing.B) {
	root, c := vmBenchWorker(b)
	ref := runtimetest.VMImage(b, root)
	ctx := context.Background()
	spec := api.SandboxSpec{Backend: "vm", Layers: []string{ref}, Memory: 1 << 30}
	var cold, byHand []time.Duration
	var last *sdk.Sandbox
	for b.Loop() {
		if last != nil {
			last.Remove(ctx, true)
		}
		byHand = append(byHand, bootByHand(b, root, ref))
		t0 := time.Now()
		sb, err := c.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		execB(b, sb, "true")
		cold = append(cold, time.Since(t0))
		last = sb
	}
	sb := last
	defer sb.Remove(ctx, true)
	// A screenshot's latency.
	var shots []time.Duration
	for range 20 {
		t0 := time.Now()
		screenshotB(b, sb)
		shots = append(shots, time.Since(t0))
		time.Sleep(50 * time.Millisecond)
	}
	// Input to screen: a key typed at the console's login prompt, until a
	// screenshot shows more than the cursor's blink changed (a text
	// cell's width and more).
	var typed []time.Duration
	for _, key := range []string{"a", "b", "c", "d", "e"} {
		before, _ := screenshotB(b, sb)
		t0 := time.Now()
		if err := sb.Press(ctx, key); err != nil {
			b.Fatal(err)
		}
		for {
			now, _ := screenshotB(b, sb)
			if changedWidth(b, before, now) > 12 {
				break
			}
			if time.Since(t0) > time.Minute {
				b.Fatal("a key typed never reached the screen")
			}
		}
		typed = append(typed, time.Since(t0))
	}
	// Idle: the host's memory for it, and its disk, after 30 s.
	time.Sleep(30 * time.Second)
	info, err := sb.Inspect(ctx)
	if err != nil {
		b.Fatal(err)
	}
	img, err := vm.Lookup(ctx, storeOf(b, root), ref)
	if err != nil {
		b.Fatal(err)
	}
	st, err := os.Stat(img.Path)
	if err != nil {
		b.Fatal(err)
	}
	// From a memory snapshot: the idle VM saved whole, then branches
	// that continue it, create to first exec, one at a time.
	sn, err := sb.PackDiff(ctx, api.PackRequest{Tag: "bench-vm:1", Memory: true})
	if err != nil {
		b.Fatal(err)
	}
	var warm []time.Duration
	for range 3 {
		t0 := time.Now()
		br, err := c.Branch(ctx, api.BranchRequest{Snapshot: sn.Name, N: 1})
		if err != nil {
			b.Fatal(err)
		}
		execB(b, br[0], "true")
		warm = append(warm, time.Since(t0))
		br[0].Remove(ctx, true)
	}
	b.ReportMetric(p50ms(cold), "cold-p50-ms")
	b.ReportMetric(p50ms(byHand), "byhand-p50-ms")
	b.ReportMetric(p50ms(warm), "restore-p50-ms")
	b.ReportMetric(sn.Memory.PausedSeconds*1000, "paused-ms")
	b.ReportMetric(float64(sn.Memory.StateBytes)/(1<<20), "state-MiB")
	b.ReportMetric(p50ms(shots), "screenshot-p50-ms")
	b.ReportMetric(p50ms(typed), "input-p50-ms")
	b.ReportMetric(float64(info.MemoryBytes)/(1<<20), "idle-host-MiB")
	b.ReportMetric(float64(spec.Memory)/(1<<20), "guest-MiB")
	b.ReportMetric(float64(info.DiskUsed)/(1<<20), "overlay-MiB")
	b.ReportMetric(float64(st.Size())/(1<<20), "image-MiB")
	accel := 0.0
	if info.VM != nil && info.VM.Accel == "kvm" {
		accel = 1
	}
	b.ReportMetric(accel, "kvm")
}

// p50ms is the median of ds in milliseconds (ds sorted).
func p50ms(ds []time.Duration) float64 {
	slices.Sort(ds)
	return ms(p50(ds))
}

// vmBenchWorker starts a worker of the vm backend on a fresh root.
func vmBenchWorker(b *testing.B) (root string, c *sdk.Client) {
	agent, err := microvmtest.Agent()
	if err != nil {
		b.Fatal(err)
	}
	root = b.TempDir()
	runtimetest.Layers(b, root)
	w := runtimetest.StartWorkerWith(b, root, runtimetest.Config{VM: vms.Settings{Agent: agent}})
	b.Cleanup(func() { w.Kill(); runtimetest.Clean(root) })
	if c, err = sdk.New(sdk.Options{Root: root}); err != nil {
		b.Fatal(err)
	}
	return root, c
}

// screenshotB is sb's screen.
func screenshotB(b *testing.B, sb *sdk.Sandbox) ([]byte, api.Screenshot) {
	b.Helper()
	png, info, err := sb.Screenshot(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	return png, info
}

// bootByHand boots the VM image ref of root's store with QEMU alone, as
// docs/vm.md shows (an overlay of its disk, the firmware's variables
// copied), to its login prompt on the serial console, and says how long
// that took.
func bootByHand(b *testing.B, root, ref string) time.Duration {
	b.Helper()
	img, err := vm.Lookup(context.Background(), storeOf(b, root), ref)
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	overlay, vars := filepath.Join(dir, "disk.qcow2"), filepath.Join(dir, "vars.fd")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", img.Path, "-F", "qcow2", overlay).CombinedOutput(); err != nil {
		b.Fatalf("qemu-img: %v: %s", err, out)
	}
	if out, err := exec.Command("cp", vm.OVMFVars, vars).CombinedOutput(); err != nil {
		b.Fatalf("cp: %v: %s", err, out)
	}
	t0 := time.Now()
	qemu := exec.Command("qemu-system-x86_64", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-machine", "q35", "-accel", "tcg,tb-size=64", "-cpu", "qemu64", "-smp", "1", "-m", "1024",
		"-drive", "if=pflash,format=raw,readonly=on,file="+vm.OVMFCode, "-drive", "if=pflash,format=raw,file="+vars,
		"-drive", "if=virtio,format=qcow2,file="+overlay, "-serial", "stdio",
		"-device", "virtio-rng-pci") // as a VM of dsec's has: a guest short of entropy boots slower
	out, err := qemu.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	qemu.Stderr = qemu.Stdout
	if err := qemu.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { qemu.Process.Kill(); qemu.Wait() }()
	found := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(out)
		sc.Split(bufio.ScanWords)
		for sc.Scan() {
			if strings.HasSuffix(sc.Text(), "login:") {
				close(found)
				break
			}
		}
		for sc.Scan() {
		}
	}()
	select {
	case <-found:
		return time.Since(t0)
	case <-time.After(5 * time.Minute):
		b.Fatal("QEMU alone never reached the login prompt")
	}
	return 0
}

// changedWidth is the width of the smallest rectangle holding every
// pixel the PNGs a and b differ in.
func changedWidth(b *testing.B, a, c []byte) int {
	b.Helper()
	return changedWidthBelow(b, a, c, 0)
}

// changedWidthBelow is changedWidth of what lies top pixels or more
// below the screen's top.
func changedWidthBelow(b *testing.B, a, c []byte, top int) int {
	b.Helper()
	ma, err := png.Decode(bytes.NewReader(a))
	if err != nil {
		b.Fatal(err)
	}
	mc, err := png.Decode(bytes.NewReader(c))
	if err != nil {
		b.Fatal(err)
	}
	if ma.Bounds() != mc.Bounds() {
		return ma.Bounds().Dx()
	}
	lo, hi := -1, -1
	for y := ma.Bounds().Min.Y + top; y < ma.Bounds().Max.Y; y++ {
		for x := ma.Bounds().Min.X; x < ma.Bounds().Max.X; x++ {
			if ma.At(x, y) != mc.At(x, y) {
				if lo < 0 || x < lo {
					lo = x
				}
				hi = max(hi, x)
			}
		}
	}
	if lo < 0 {
		return 0
	}
	return hi - lo + 1
}

// storeOf opens root's store.
func storeOf(b *testing.B, root string) *store.Store {
	b.Helper()
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		b.Fatal(err)
	}
	return s
}
