package vmm

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
	"github.com/dsec-project/dsec/internal/runtime/screen"
)

// noScreen starts the shim's answer for a machine without a display.
const noScreen = "this guest has no screen"

// screen answers OpScreen and OpInput through QMP: screendump writes
// the display's surface as PNG; send-key presses each key (QEMU queues
// them, each held 100 ms, in order); input-send-event moves and clicks
// the tablet.
func (v *vmm) screen(r initproto.Request) error {
	if !v.spec.Display {
		return errors.New(noScreen + " (a microVM's has none; a full VM's has: --backend vm)")
	}
	if r.Op == initproto.OpScreen {
		if r.Path == "" {
			return errors.New("a screenshot needs a path")
		}
		_, err := v.qmp.do("screendump", map[string]any{"filename": r.Path, "format": "png"})
		return err
	}
	for _, k := range r.Keys {
		keys := make([]map[string]string, len(k))
		for i, q := range k {
			keys[i] = map[string]string{"type": "qcode", "data": q}
		}
		if _, err := v.qmp.do("send-key", map[string]any{"keys": keys}); err != nil {
			return err
		}
	}
	// A move's axes go together; each button's press and release apart,
	// each a report of its own, for the guest to see both.
	for i := 0; i < len(r.Events); {
		j := i + 1
		for r.Events[i].Type == "abs" && j < len(r.Events) && r.Events[j].Type == "abs" {
			j++
		}
		if _, err := v.qmp.do("input-send-event", map[string]any{"events": r.Events[i:j]}); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// Screenshot has the shim write the guest's screen to path as PNG.
func (v *VM) Screenshot(ctx context.Context, path string) error {
	_, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpScreen, ID: fmt.Sprintf("#screen-%d", initproto.RestrictSeq.Add(1)), Path: path}, nil, nil)
	return screenErr(err)
}

// Input presses keys, then sends events, to the guest's keyboard and
// tablet.
func (v *VM) Input(ctx context.Context, keys []screen.Key, events []screen.Event) error {
	_, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpInput, ID: fmt.Sprintf("#input-%d", initproto.RestrictSeq.Add(1)), Keys: keys, Events: events}, nil, nil)
	return screenErr(err)
}

// screenErr is a shim's error as the worker classes it: a machine
// without a screen cannot do it (not implemented); else QEMU failed.
func screenErr(err error) error {
	switch {
	case err == nil:
		return nil
	case strings.Contains(err.Error(), noScreen):
		return fmt.Errorf("%v: %w", err, errdefs.ErrNotImplemented)
	}
	return fmt.Errorf("the machine's screen: %v: %w", err, errdefs.ErrUnavailable)
}
