package vmm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// diskDevice is the id of a full VM's disk (vms.Machine names it).
const diskDevice = "vdisk"

// diskSnapshot stacks the empty qcow2 image next over the top of the
// guest's disk, which must be the file current, while the guest runs:
// what it writes from then on goes to next, and current holds the disk
// as it was (a full VM's snapshot, copied from it).
func (v *vmm) diskSnapshot(current, next string) error {
	if current == "" || next == "" {
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
			File string `json:"file"`
		} `json:"inserted"`
	}
	if err := json.Unmarshal(b, &devs); err != nil {
		return fmt.Errorf("query-block: %w", err)
	}
	node, file := "", ""
	for _, d := range devs {
		if strings.Contains(d.QDev, "/"+diskDevice+"/") && d.Inserted != nil {
			node, file = d.Inserted.Node, fileOf(d.Inserted.File)
		}
	}
	switch {
	case node == "":
		return errors.New("this guest has no disk of its own to snapshot (a microVM's is its upper's image)")
	case file != current:
		return fmt.Errorf("the guest's disk is %s, not %s as its sandbox's state says (a snapshot its worker did not see end): stop and start the sandbox, then snapshot it", file, current)
	}
	name := fmt.Sprintf("top%d", time.Now().UnixNano())
	add := map[string]any{"driver": "qcow2", "node-name": name, "backing": nil, "discard": "unmap",
		"file": map[string]any{"driver": "file", "filename": next, "aio": "threads", "discard": "unmap"}}
	if _, err := v.qmp.do("blockdev-add", add); err != nil {
		return fmt.Errorf("open %s: %w", next, err)
	}
	if _, err := v.qmp.do("blockdev-snapshot", map[string]any{"node": node, "overlay": name}); err != nil {
		v.qmp.do("blockdev-del", map[string]any{"node-name": name})
		return fmt.Errorf("stack %s over the disk: %w", next, err)
	}
	return nil
}

// SnapshotDisk has the shim stack next, an empty qcow2 image, over the
// guest's disk's top, the file current (a full VM's).
func (v *VM) SnapshotDisk(ctx context.Context, current, next string) error {
	_, err := v.c.Do(ctx, initproto.Request{Op: initproto.OpDiskSnap, ID: fmt.Sprintf("#disksnap-%d", initproto.RestrictSeq.Add(1)), Current: current, Path: next}, nil, nil)
	return err
}

// fileOf is the file of a node's image as QEMU names it: its own file
// name, or, for a node whose options say more than a file name can (a
// backing given, not read from the image), the file in its options'
// JSON.
func fileOf(name string) string {
	j, ok := strings.CutPrefix(name, "json:")
	if !ok {
		return name
	}
	var o struct {
		File struct {
			Filename string `json:"filename"`
		} `json:"file"`
	}
	if json.Unmarshal([]byte(j), &o) != nil {
		return name
	}
	return o.File.Filename
}
