package vms_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"image"
	"image/png"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestVMScreen: a full VM's screen is a PNG of its display, counted;
// text typed on its keyboard appears there, in one line of the screen's
// text, and nowhere else; a key by name presses it; the mouse takes a
// point on the screen and refuses one off it; a VNC grant opens its
// screen (testVNC); a container has no screen, and says so.
func TestVMScreen(t *testing.T) {
	agent := staticAgent(t)
	cfg, worker := tcpWorker(t)
	cfg.VM = vms.Settings{Agent: agent}
	w, c := setup(t, cfg)
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
	testVNC(t, c, sb, before.Bounds())
	// The same through a fleet's gateway: its grants are the worker's,
	// and the WebSocket, which no token of the gateway's opens, is
	// relayed to the worker holding the sandbox.
	gc := gatewayOf(t, worker(w))
	testVNC(t, gc, gc.Sandbox(sb.Name), before.Bounds())
	ct := create(t, c, api.SandboxSpec{Name: "ct", Layers: []string{"bb:1"}})
	if _, err := ct.VNC(ctx); !errdefs.IsNotImplemented(err) {
		t.Errorf("a container's VNC: %v", err)
	}
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

// testVNC: a VNC grant's WebSocket speaks RFB with the VM's own screen
// (its size the screenshots'); a wrong token, or another sandbox's
// name with it, is refused; a new grant ends the one before and its
// connections, and a revocation the new one.
func testVNC(t *testing.T, c *sdk.Client, sb *sdk.Sandbox, screen image.Rectangle) {
	ctx := context.Background()
	g, err := sb.VNC(ctx)
	if err != nil || g.Sandbox != sb.Name || len(g.Token) < 32 || g.Path != "/v1/vnc/"+sb.Name {
		t.Fatalf("a VNC grant: %+v %v", g, err)
	}
	conn, err := c.DialVNC(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if w, h := rfbHandshake(t, conn); w != screen.Dx() || h != screen.Dy() {
		t.Errorf("VNC's screen is %dx%d, the screenshots' %v", w, h, screen)
	}
	for _, bad := range []api.VNC{{Sandbox: g.Sandbox, Path: g.Path, Token: g.Token[1:]}, {Sandbox: "other", Path: api.VNCPath("other"), Token: g.Token}} {
		if _, err := c.DialVNC(ctx, bad); !errdefs.IsPermissionDenied(err) {
			t.Errorf("VNC with %+v: %v, want permission denied", bad, err)
		}
	}
	g2, err := sb.VNC(ctx)
	if err != nil || g2.Token == g.Token {
		t.Fatalf("a second grant: %+v %v", g2, err)
	}
	closed := func(conn net.Conn, what string) {
		t.Helper()
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadAll(conn); os.IsTimeout(err) || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: its connection is still open", what)
		}
	}
	closed(conn, "a grant replaced")
	if _, err := c.DialVNC(ctx, g); !errdefs.IsPermissionDenied(err) {
		t.Errorf("a replaced grant: %v, want permission denied", err)
	}
	conn2, err := c.DialVNC(ctx, g2)
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close()
	rfbHandshake(t, conn2)
	if err := sb.RevokeVNC(ctx); err != nil {
		t.Fatal(err)
	}
	closed(conn2, "a grant revoked")
	if _, err := c.DialVNC(ctx, g2); !errdefs.IsPermissionDenied(err) {
		t.Errorf("a revoked grant: %v, want permission denied", err)
	}
}

// rfbHandshake speaks RFB 3.8 on conn up to the server's init (no
// authentication: only the worker reaches the server), and returns the
// framebuffer's size it says.
func rfbHandshake(t *testing.T, conn net.Conn) (w, h int) {
	t.Helper()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	defer conn.SetDeadline(time.Time{})
	read := func(n int) []byte {
		t.Helper()
		b := make([]byte, n)
		if _, err := io.ReadFull(conn, b); err != nil {
			t.Fatalf("RFB: %v", err)
		}
		return b
	}
	if v := string(read(12)); v != "RFB 003.008\n" {
		t.Fatalf("RFB version %q", v)
	}
	conn.Write([]byte("RFB 003.008\n"))
	types := read(int(read(1)[0]))
	if !bytes.Contains(types, []byte{1}) {
		t.Fatalf("RFB security types %v, want None (1)", types)
	}
	conn.Write([]byte{1})
	if r := read(4); !bytes.Equal(r, []byte{0, 0, 0, 0}) {
		t.Fatalf("RFB security result %v", r)
	}
	conn.Write([]byte{1}) // shared
	init := read(24)
	return int(binary.BigEndian.Uint16(init[0:2])), int(binary.BigEndian.Uint16(init[2:4]))
}

// TestDesktop: the display test: a full VM of a Debian image with Xfce
// (runtimetest.DesktopImage) boots to its desktop, logged in; the keys
// ctrl+alt+t open a terminal (Xfce's shortcut); echo typed into it and
// Return put the command and its output on the screen, inside the
// terminal's window: a screenshot after, against one before typing,
// changed there and (a clock's tick aside) little elsewhere; and the
// shell in it ran the command.
func TestDesktop(t *testing.T) {
	w, c := setup(t, runtimetest.Config{VM: vms.Settings{Agent: staticAgent(t)}})
	img := runtimetest.DesktopImage(t, w.Root)
	ctx := context.Background()
	t0 := time.Now()
	sb := create(t, c, api.SandboxSpec{Name: "xfce", Backend: vms.VM, Layers: []string{img}, Memory: 1536 << 20, CPU: 2})
	booted := time.Since(t0)
	running := func(procs string) bool {
		res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", "for p in " + procs + "; do pgrep -x $p >/dev/null || exit 1; done"}})
		return err == nil && res.ExitCode == 0
	}
	for deadline := time.Now().Add(5 * time.Minute); !running("Xorg xfwm4 xfce4-panel xfdesktop"); time.Sleep(2 * time.Second) {
		if time.Now().After(deadline) {
			t.Fatal("the desktop never came up (Xorg, xfwm4, xfce4-panel, xfdesktop)")
		}
	}
	// X comes up black; the desktop is its wallpaper painted, then the
	// panel's bar across the top.
	desk := settled(t, sb, nil)
	for deadline := time.Now().Add(3 * time.Minute); !painted(desk) || !barOnTop(desk); desk = settled(t, sb, nil) {
		if time.Now().After(deadline) {
			keepShots(t, map[string]*image.RGBA{"desk": desk})
			t.Fatal("the desktop never painted its wallpaper and its panel")
		}
		time.Sleep(2 * time.Second)
	}
	t.Logf("the desktop: agent-ready %v after the create, the desktop settled %v after", booted.Round(time.Second), time.Since(t0).Round(time.Second))
	if err := sb.Press(ctx, "ctrl+alt+t"); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(3 * time.Minute); !running("xfce4-terminal"); time.Sleep(time.Second) {
		if time.Now().After(deadline) {
			t.Fatal("ctrl+alt+t opened no terminal")
		}
	}
	term := settled(t, sb, desk, image.Pt(200, 100)) // its window shown
	window := diff(desk, term)
	if window.Dx() < 200 || window.Dy() < 100 {
		t.Fatalf("the terminal's window: the screen changed in %v only", window)
	}
	if err := sb.Type(ctx, "echo dsec-on-the-desktop | tee /tmp/typed"); err != nil {
		t.Fatal(err)
	}
	if err := sb.Press(ctx, "Return"); err != nil {
		t.Fatal(err)
	}
	typed := settled(t, sb, term, image.Pt(8*20, 16)) // (20 characters at least)
	keepShots(t, map[string]*image.RGBA{"desk": desk, "term": term, "typed": typed})
	in, out := changedIn(term, typed, window)
	if in < 300 || out > in/4 {
		t.Errorf("echo typed in the terminal changed %d pixels in its window %v and %d outside, want the text's (hundreds) inside", in, window, out)
	}
	// The shell in that terminal ran what was typed.
	var got bytes.Buffer
	if res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"cat", "/tmp/typed"}, Stdout: &got}); err != nil || res.ExitCode != 0 || got.String() != "dsec-on-the-desktop\n" {
		t.Errorf("the command typed in the terminal: %q %v %+v", got.String(), err, res)
	}
}

// changedIn counts the pixels a and b differ in inside r and outside.
func changedIn(a, b *image.RGBA, r image.Rectangle) (in, out int) {
	for y := a.Bounds().Min.Y; y < a.Bounds().Max.Y; y++ {
		for x := a.Bounds().Min.X; x < a.Bounds().Max.X; x++ {
			i := a.PixOffset(x, y)
			if !bytes.Equal(a.Pix[i:i+4], b.Pix[i:i+4]) {
				if image.Pt(x, y).In(r) {
					in++
				} else {
					out++
				}
			}
		}
	}
	return in, out
}

// keepShots writes the screenshots into the directory DSEC_TEST_SHOTS
// names, if it does, to look at when a test of the screen fails.
func keepShots(t *testing.T, shots map[string]*image.RGBA) {
	dir := os.Getenv("DSEC_TEST_SHOTS")
	if dir == "" {
		return
	}
	for name, m := range shots {
		var b bytes.Buffer
		png.Encode(&b, m)
		if err := os.WriteFile(filepath.Join(dir, t.Name()+"-"+name+".png"), b.Bytes(), 0o644); err != nil {
			t.Log(err)
		}
	}
}

// painted says whether most of m is not black.
func painted(m *image.RGBA) bool {
	n := 0
	for i := 0; i+3 < len(m.Pix); i += 4 {
		if m.Pix[i] > 8 || m.Pix[i+1] > 8 || m.Pix[i+2] > 8 {
			n++
		}
	}
	return n > len(m.Pix)/4/2
}

// barOnTop says whether a light bar (Xfce's panel) runs across most of
// m's top.
func barOnTop(m *image.RGBA) bool {
	n := 0
	for x := m.Bounds().Min.X; x < m.Bounds().Max.X; x++ {
		c := m.RGBAAt(x, m.Bounds().Min.Y+5)
		if int(c.R)+int(c.G)+int(c.B) > 3*160 {
			n++
		}
	}
	return n > m.Bounds().Dx()/2
}
