package runtime

import (
	"bytes"
	"context"
	"fmt"
	"image/png"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/screen"
)

// screenSize is a sandbox's screen as its last screenshot showed it, and
// how many were taken.
type screenSize struct {
	w, h int
	seq  int64
}

// screener is the running sandbox's screen, or why it has none.
func (sb *Sandbox) screener() (driver.Screener, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Status != Running || sb.c == nil {
		return nil, fmt.Errorf("sandbox %s is %s: start it first: %w", sb.Name, sb.Status, errdefs.ErrFailedPrecondition)
	}
	if sb.Paused {
		return nil, fmt.Errorf("sandbox %s is paused: resume it first: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	return ability[driver.Screener](sb, "show a screen")
}

// Screenshot is the sandbox's screen now, as PNG.
func (sb *Sandbox) Screenshot(ctx context.Context) ([]byte, api.Screenshot, error) {
	s, err := sb.screener()
	if err != nil {
		return nil, api.Screenshot{}, err
	}
	f, err := os.CreateTemp(sb.dir, "screen-*.png")
	if err != nil {
		return nil, api.Screenshot{}, err
	}
	f.Close()
	defer os.Remove(f.Name())
	if err := s.Screenshot(ctx, f.Name()); err != nil {
		return nil, api.Screenshot{}, err
	}
	b, err := os.ReadFile(filepath.Clean(f.Name()))
	if err != nil {
		return nil, api.Screenshot{}, err
	}
	cfg, err := png.DecodeConfig(bytes.NewReader(b))
	if err != nil {
		return nil, api.Screenshot{}, fmt.Errorf("the screenshot QEMU wrote: %v: %w", err, errdefs.ErrUnavailable)
	}
	sb.mu.Lock()
	sb.screen.w, sb.screen.h = cfg.Width, cfg.Height
	sb.screen.seq++
	info := api.Screenshot{Width: cfg.Width, Height: cfg.Height, Seq: sb.screen.seq}
	sb.mu.Unlock()
	return b, info, nil
}

// Input acts on the sandbox's keyboard or mouse as in asks. A point
// needs the screen's size: the first one takes a screenshot to learn it.
func (sb *Sandbox) Input(ctx context.Context, in api.Input) error {
	set := 0
	for _, b := range []bool{in.Text != "", in.Key != "", in.Move != nil, in.Click != nil, in.Drag != nil, in.Scroll != 0} {
		if b {
			set++
		}
	}
	if set != 1 {
		return fmt.Errorf("an input is one of text, key, move, click, drag or scroll (%d given): %w", set, errdefs.ErrInvalidArgument)
	}
	s, err := sb.screener()
	if err != nil {
		return err
	}
	var keys []screen.Key
	switch {
	case in.Text != "":
		keys, err = screen.Text(in.Text)
	case in.Key != "":
		var k screen.Key
		k, err = screen.Combo(in.Key)
		keys = []screen.Key{k}
	}
	if err != nil {
		return err
	}
	if keys != nil {
		return s.Input(ctx, keys, nil)
	}
	events, err := sb.pointer(ctx, in)
	if err != nil {
		return err
	}
	return s.Input(ctx, nil, events)
}

// pointer is the tablet's events for a move, click, drag or scroll.
func (sb *Sandbox) pointer(ctx context.Context, in api.Input) ([]screen.Event, error) {
	sb.mu.Lock()
	w, h := sb.screen.w, sb.screen.h
	sb.mu.Unlock()
	if w == 0 && in.Scroll == 0 {
		if _, shot, err := sb.Screenshot(ctx); err != nil {
			return nil, err
		} else {
			w, h = shot.Width, shot.Height
		}
	}
	press := func(button string, events []screen.Event) ([]screen.Event, error) {
		down, err := screen.Button(button, true)
		if err != nil {
			return nil, err
		}
		up, _ := screen.Button(button, false)
		return append(events, down, up), nil
	}
	switch {
	case in.Move != nil:
		return screen.Move(in.Move.X, in.Move.Y, w, h)
	case in.Click != nil:
		events, err := screen.Move(in.Click.X, in.Click.Y, w, h)
		if err != nil {
			return nil, err
		}
		button := in.Click.Button
		if button == "" {
			button = "left"
		}
		if events, err = press(button, events); err != nil || !in.Click.Double {
			return events, err
		}
		return press(button, events)
	case in.Drag != nil:
		from, err := screen.Move(in.Drag.From.X, in.Drag.From.Y, w, h)
		if err != nil {
			return nil, err
		}
		to, err := screen.Move(in.Drag.To.X, in.Drag.To.Y, w, h)
		if err != nil {
			return nil, err
		}
		down, _ := screen.Button("left", true)
		up, _ := screen.Button("left", false)
		return append(append(append(from, down), to...), up), nil
	}
	// A wheel's notch is a press and release of its button.
	button, n := "wheel-down", in.Scroll
	if n < 0 {
		button, n = "wheel-up", -n
	}
	if n > 100 {
		return nil, fmt.Errorf("%d notches of scroll: give at most 100 at once: %w", n, errdefs.ErrInvalidArgument)
	}
	var events []screen.Event
	for range n {
		events, _ = press(button, events)
	}
	return events, nil
}

// VNC is the unix socket the running sandbox's VNC server listens on
// (a full VM's): the worker's grants reach it, nothing else.
func (sb *Sandbox) VNC() (string, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Status != Running || sb.c == nil {
		return "", fmt.Errorf("sandbox %s is %s: start it first: %w", sb.Name, sb.Status, errdefs.ErrFailedPrecondition)
	}
	v, ok := sb.d.(driver.VNCServer)
	if !ok {
		return "", fmt.Errorf("the %s backend has no screen to serve over VNC (a full VM's has: --backend vm): %w", sb.backendName(), errdefs.ErrNotImplemented)
	}
	return v.VNC(sb.handle())
}
