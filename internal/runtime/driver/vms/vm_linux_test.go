package vms_test

import (
	"bytes"
	"context"
	"image"
	"image/png"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/backend/backendtest"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// The vm backend through a real worker and the SDK: its own package, so
// that its boots (some 30 s each under TCG) run beside the sdk package's
// tests rather than after them.

// TestMain doubles as a sandbox init, a guest's shim and agent, and a
// worker.
func TestMain(m *testing.M) {
	container.MaybeInit()
	vmm.MaybeRun()
	agent.MaybeRun()
	runtimetest.MaybeWorker()
	os.Exit(m.Run())
}

// staticAgent is a static dsec-init: the agent a guest runs on its own
// libc.
func staticAgent(t testing.TB) string {
	t.Helper()
	a, err := microvmtest.Agent()
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// setup starts a worker of cfg on a fresh root with the test layers (bb:1,
// ws:1); cleanup kills it, removes every sandbox and checks nothing is
// left.
func setup(t *testing.T, cfg runtimetest.Config) (*runtimetest.Worker, *sdk.Client) {
	t.Helper()
	root := t.TempDir()
	runtimetest.Layers(t, root)
	w := runtimetest.StartWorkerWith(t, root, cfg)
	t.Cleanup(func() {
		w.Kill()
		runtimetest.Clean(root)
		if l := runtimetest.Leftovers(root); len(l) > 0 {
			t.Errorf("left behind: %v", l)
		}
	})
	c, err := sdk.New(sdk.Options{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	return w, c
}

func create(t *testing.T, c *sdk.Client, spec api.SandboxSpec) *sdk.Sandbox {
	t.Helper()
	sb, err := c.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

// TestConformance holds the vm backend to the conformance suite every
// backend passes: full VMs booted through UEFI firmware from a Debian
// image, their agent a service of the guest's systemd (TCG here: each
// boot takes some 30 s). Its sandboxes cannot be packed yet (snapshots
// of a VM are a block diff of its disk, not built): PackDiff holds it to
// refusing.
func TestConformance(t *testing.T) {
	cfg := runtimetest.Config{VM: vms.Settings{Agent: staticAgent(t)}}
	backendtest.Run(t, func(t *testing.T) *backendtest.Env {
		w, c := setup(t, cfg)
		return &backendtest.Env{
			Backend: vms.VM,
			Layers:  []string{runtimetest.VMImage(t, w.Root)},
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
			Leftovers:  func() []string { return runtimetest.Leftovers(w.Root) },
			Root:       w.Root,
			NoPackDiff: "a vm sandbox's files are its own disk's: its snapshots (a block diff of the disk) are not in this release",
		}
	})
}

// TestVMScreen: a full VM's screen is a PNG of its display, counted;
// text typed on its keyboard appears there, in one line of the screen's
// text, and nowhere else; a key by name presses it; the mouse takes a
// point on the screen and refuses one off it; a container has no
// screen, and says so.
func TestVMScreen(t *testing.T) {
	agent := staticAgent(t)
	w, c := setup(t, runtimetest.Config{VM: vms.Settings{Agent: agent}})
	img := runtimetest.VMImage(t, w.Root)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{Name: "desk", Backend: "vm", Layers: []string{img}})

	// The console on the display settles to its login prompt.
	var before *image.RGBA
	var seq int64
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(2 * time.Second) {
		shot, info := screenshot(t, sb)
		if info.Width < 640 || info.Height < 400 || info.Seq <= seq {
			t.Fatalf("screenshot: %+v after %d, want a screen of at least 640x400 counted on", info, seq)
		}
		seq = info.Seq
		if before != nil && diff(before, shot).Empty() {
			break
		}
		before = shot
		if time.Now().After(deadline) {
			t.Fatal("the screen never settled")
		}
	}
	if err := sb.Type(ctx, "dsec-was-here"); err != nil {
		t.Fatal(err)
	}
	// Each key is held 100 ms: the text appears as it is typed, until
	// the change stops growing.
	var changed image.Rectangle
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Second) {
		after, _ := screenshot(t, sb)
		d := diff(before, after)
		if !d.Empty() && d == changed {
			break
		}
		changed = d
		if time.Now().After(deadline) {
			t.Fatalf("text typed on the keyboard never settled on the screen (changed %v)", changed)
		}
	}
	// 13 characters, one text line: a band of the screen, not the screen.
	if changed.Dy() > 32 || changed.Dx() < 13*6 || changed.Dx() > before.Bounds().Dx()/2 {
		t.Errorf("typing one line changed %v of the %v screen, want one line's band", changed, before.Bounds())
	}
	if err := sb.Press(ctx, "ctrl+u"); err != nil { // the prompt's line erased
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Second) {
		after, _ := screenshot(t, sb)
		if d := diff(before, after); d.Empty() || d.Dy() <= 32 && !d.Overlaps(changed) {
			break // (the cursor may have blinked elsewhere)
		}
		if time.Now().After(deadline) {
			t.Fatal("ctrl+u never erased the typed line")
		}
	}
	if err := sb.Click(ctx, 10, 10); err != nil {
		t.Errorf("a click on the screen: %v", err)
	}
	if err := sb.Input(ctx, api.Input{Scroll: -2}); err != nil {
		t.Errorf("a scroll: %v", err)
	}
	for _, bad := range []struct {
		in   api.Input
		says string
	}{
		{api.Input{Click: &api.Click{Point: api.Point{X: 5000, Y: 10}}}, "off the"},
		{api.Input{Key: "hyper+q"}, `no key "hyper"`},
		{api.Input{Text: "naïve"}, "cannot be typed"},
		{api.Input{Text: "a", Key: "b"}, "2 given"},
		{api.Input{Click: &api.Click{Point: api.Point{X: 1, Y: 1}, Button: "fourth"}}, "no mouse button"},
	} {
		if err := sb.Input(ctx, bad.in); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), bad.says) {
			t.Errorf("input %+v: %v, want invalid argument saying %q", bad.in, err, bad.says)
		}
	}
	ct := create(t, c, api.SandboxSpec{Name: "ct", Layers: []string{"bb:1"}})
	if _, _, err := ct.Screenshot(ctx); !errdefs.IsNotImplemented(err) || !strings.Contains(err.Error(), "show a screen") {
		t.Errorf("a container's screen: %v", err)
	}
	if err := ct.Type(ctx, "x"); !errdefs.IsNotImplemented(err) {
		t.Errorf("a container's keyboard: %v", err)
	}
}

// screenshot takes sb's screen, decoded.
func screenshot(t *testing.T, sb *sdk.Sandbox) (*image.RGBA, api.Screenshot) {
	t.Helper()
	b, info, err := sb.Screenshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("the screenshot is no PNG: %v", err)
	}
	if m.Bounds().Dx() != info.Width || m.Bounds().Dy() != info.Height {
		t.Fatalf("a PNG of %v, said to be %dx%d", m.Bounds(), info.Width, info.Height)
	}
	rgba := image.NewRGBA(m.Bounds())
	for y := m.Bounds().Min.Y; y < m.Bounds().Max.Y; y++ {
		for x := m.Bounds().Min.X; x < m.Bounds().Max.X; x++ {
			rgba.Set(x, y, m.At(x, y))
		}
	}
	return rgba, info
}

// diff is the smallest rectangle holding every pixel a and b differ in
// (empty: none), the text cursor's blink aside: a block of at most 2
// text rows by 1 column that differs alone is the cursor.
func diff(a, b *image.RGBA) image.Rectangle {
	if a.Bounds() != b.Bounds() {
		return a.Bounds()
	}
	var r image.Rectangle
	for y := a.Bounds().Min.Y; y < a.Bounds().Max.Y; y++ {
		for x := a.Bounds().Min.X; x < a.Bounds().Max.X; x++ {
			i := a.PixOffset(x, y)
			if !bytes.Equal(a.Pix[i:i+4], b.Pix[i:i+4]) {
				r = r.Union(image.Rect(x, y, x+1, y+1))
			}
		}
	}
	if r.Dx() <= 9 && r.Dy() <= 32 {
		return image.Rectangle{}
	}
	return r
}
