package vmm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// diskDevice is the id of a full VM's disk (vms.Machine names it).
const diskDevice = "vdisk"

// notOnTop starts the shim's answer when the disk's top is not the node
// the worker names.
const notOnTop = "the guest's disk is on node"

// diskSnapshot stacks the empty qcow2 image path, as node name, over the
// top of the guest's disk, which must be node current, while the guest
// runs: what it writes from then on goes to path, and current's image
// holds the disk as it was (a full VM's snapshot, copied from it). An
// error leaves the disk on current.
func (v *vmm) diskSnapshot(current, name, path string) error {
	if current == "" || name == "" || path == "" {
		return errors.New("a disk snapshot needs the disk's top and the image to stack over it")
	}
	b, err := v.qmp.do("query-block", nil)
	if err != nil {
		return err
	}
	var devs []struct {
		QDev     string `json:"qdev"`
		Inserted *struct {
			Node string `json:"node-name"`
		} `json:"inserted"`
	}
	if err := json.Unmarshal(b, &devs); err != nil {
		return fmt.Errorf("query-block: %w", err)
	}
	node := ""
	for _, d := range devs {
		if strings.Contains(d.QDev, "/"+diskDevice+"/") && d.Inserted != nil {
			node = d.Inserted.Node
		}
	}
	switch {
	case node == "":
		return errors.New("this guest has no disk of its own to snapshot (a microVM's is its upper's image)")
	case node != current:
		return fmt.Errorf("%s %s, not %s as its sandbox's state says (a snapshot its worker did not see end, or an older dsec started it): stop and start the sandbox, then snapshot it", notOnTop, node, current)
	}
	add := map[string]any{"driver": "qcow2", "node-name": name, "backing": nil, "discard": "unmap",
		"file": map[string]any{"driver": "file", "filename": path, "aio": "threads", "discard": "unmap"}}
	if _, err := v.qmp.do("blockdev-add", add); err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	if _, err := v.qmp.do("blockdev-snapshot", map[string]any{"node": node, "overlay": name}); err != nil {
		v.qmp.do("blockdev-del", map[string]any{"node-name": name})
		return fmt.Errorf("stack %s over the disk: %w", path, err)
	}
	return nil
}

// NotStacked is the shim's refusal of a disk snapshot: the disk is on
// the top it was on, and QEMU never opened the image to stack.
type NotStacked struct{ Err error }

func (e *NotStacked) Error() string { return e.Err.Error() }
func (e *NotStacked) Unwrap() error { return e.Err }

// SnapshotDisk has the shim stack path, an empty qcow2 image, as node
// name over the guest's disk's top, node current (a full VM's). A
// refusal the shim answered is a *NotStacked; any other error (the shim
// gone, say) says nothing of where the disk is.
func (v *VM) SnapshotDisk(ctx context.Context, current, name, path string) error {
	rep, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpDiskSnap, ID: fmt.Sprintf("#disksnap-%d", initproto.RestrictSeq.Add(1)),
		Current: current, Node: name, Path: path}, nil, nil)
	switch {
	case err == nil:
		return nil
	case rep.Error == "":
		return err
	case strings.Contains(err.Error(), notOnTop):
		return &NotStacked{fmt.Errorf("%v: %w", err, errdefs.ErrFailedPrecondition)}
	}
	return &NotStacked{fmt.Errorf("%v: %w", err, errdefs.ErrUnavailable)}
}

// SnapshotFull saves the full VM whole (see the shim's snapshotFull):
// its device state and RAM to state, and its disk by stacking path, as
// node name, over its top, node current, while it is stopped. A refusal
// that left the disk on its top is a *NotStacked.
func (v *VM) SnapshotFull(ctx context.Context, state *os.File, current, name, path string) (*initproto.SnapshotInfo, error) {
	rep, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpSnapshot, ID: fmt.Sprintf("#snapshot-%d", initproto.RestrictSeq.Add(1)),
		Current: current, Node: name, Path: path}, unix.UnixRights(int(state.Fd())), nil)
	switch {
	case err == nil && rep.Snapshot == nil:
		return nil, errors.New("the VM's shim answered a snapshot with nothing (an older dsec's: stop and start the sandbox)")
	case err == nil:
		return rep.Snapshot, nil
	case rep.Error == "" || !strings.HasPrefix(rep.Error, notStackedPrefix):
		return nil, err
	case strings.Contains(err.Error(), notOnTop) || strings.Contains(err.Error(), "commands run in the guest"):
		return nil, &NotStacked{fmt.Errorf("%v: %w", err, errdefs.ErrFailedPrecondition)}
	}
	return nil, &NotStacked{fmt.Errorf("%v: %w", err, errdefs.ErrUnavailable)}
}
