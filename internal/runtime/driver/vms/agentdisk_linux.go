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

	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// agentDisk is the disk a full VM's agent comes on: an ext4 file system
// (no journal: the guest mounts it read-only) holding agent as
// vm.AgentBinary, made once per agent binary under dir and shared by
// every VM of the host, read-only.
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
	if err != nil {
		return "", err
	}
	tmp := path + ".tmp-" + filepath.Base(tree)
	kib := (size+size/8)/1024 + 4096 // the binary, and ext4's own
	out, err := exec.CommandContext(ctx, "mke2fs", "-q", "-F", "-t", "ext4", "-O", "^has_journal", "-L", vm.AgentDiskSerial,
		"-d", tree, tmp, fmt.Sprintf("%dk", kib)).CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("make the guest agent's disk: mke2fs: %v: %s", err, strings.TrimSpace(string(out)))
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
