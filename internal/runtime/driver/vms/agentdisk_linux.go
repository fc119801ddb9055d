package vms

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// agentDisk is the disk a full VM's agent comes on: an ext4 file system
// (no journal: the guest mounts it read-only) holding agent as
// vm.AgentBinary, made once per agent binary under dir and shared by
// every VM of the host, read-only. Its bytes are the agent's alone (its
// UUID, hash seed and times fixed): a guest saved running, which may
// read the disk again, finds the same blocks on a disk made again.
func agentDisk(ctx context.Context, dir, agent string) (string, error) {
	f, err := os.Open(agent)
	if err != nil {
		return "", fmt.Errorf("the guest agent: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	size, err := io.Copy(h, f)
	if err != nil {
		return "", fmt.Errorf("the guest agent: %w", err)
	}
	path := filepath.Join(dir, "agent-"+hex.EncodeToString(h.Sum(nil))[:24]+".img")
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	tree, err := os.MkdirTemp(dir, "agent-tree-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tree)
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	bin, err := os.OpenFile(filepath.Join(tree, vm.AgentBinary), os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		return "", err
	}
	_, err = io.Copy(bin, f)
	if cerr := bin.Close(); err == nil {
		err = cerr
	}
	for _, p := range []string{bin.Name(), tree} {
		if err == nil {
			err = os.Chtimes(p, agentTime, agentTime)
		}
	}
	if err != nil {
		return "", err
	}
	tmp := path + ".tmp-" + filepath.Base(tree)
	kib := (size+size/8)/1024 + 4096 // the binary, and ext4's own
	b := h.Sum(nil)[:16]             // a UUID of version 4's form, the agent's
	b[6], b[8] = b[6]&0x0f|0x40, b[8]&0x3f|0x80
	id := fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
	mk := exec.CommandContext(ctx, "mke2fs", "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-L", vm.AgentDiskSerial,
		"-U", id, "-E", "hash_seed="+id, "-d", tree, tmp, fmt.Sprintf("%dk", kib))
	mk.Env = append(os.Environ(), fmt.Sprintf("E2FSPROGS_FAKE_TIME=%d", agentTime.Unix()))
	out, err := mk.CombinedOutput()
	if err == nil { // the binary's ctime, which mke2fs copies and no one sets
		fix := exec.CommandContext(ctx, "debugfs", "-w", "-R", fmt.Sprintf("set_inode_field /%s ctime @%d", vm.AgentBinary, agentTime.Unix()), tmp)
		fix.Env = mk.Env
		out, err = fix.CombinedOutput()
	}
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("make the guest agent's disk: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return "", err
	}
	// Another dsec's agent disks go: a running guest keeps its own
	// open, and a guest started again gets this one.
	old, _ := filepath.Glob(filepath.Join(dir, "agent-*.img"))
	for _, p := range old {
		if p != path {
			os.Remove(p)
		}
	}
	return path, nil
}

// agentTime is every time on an agent's disk.
var agentTime = time.Unix(1700000000, 0)
