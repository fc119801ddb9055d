package vms

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// qemuIO runs qemu-io's commands on the chain files, topmost first.
func qemuIO(t *testing.T, files []string, cmds ...string) string {
	t.Helper()
	args := []string{}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, err := exec.Command("qemu-io", append(args, chainSpec(files...))...).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-io %v: %v: %s", cmds, err, out)
	}
	return string(out)
}

// TestTop: a sandbox's first start makes its top, empty, of the chain's
// size and naming no backing file, and finds it again after; a top a
// snapshot stacked that the state never named is merged into the one
// it names, with what the guest wrote since, and removed.
func TestTop(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Fatal("qemu-io is missing: make deps installs qemu-utils")
	}
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", base, "64M").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	qemuIO(t, []string{base}, "write -P 0xaa 0 1M")
	upper := filepath.Join(dir, "upper")
	os.Mkdir(upper, 0o755)
	p, err := top(ctx, upper, []string{base}, 0)
	if err != nil || p != filepath.Join(upper, "disk.qcow2") {
		t.Fatalf("top: %q %v", p, err)
	}
	if size, err := virtualSize(ctx, p); err != nil || size != 64<<20 {
		t.Fatalf("the top's size: %d %v", size, err)
	}
	if out, _ := exec.Command("qemu-img", "info", "-U", p).Output(); strings.Contains(string(out), "backing file") {
		t.Fatalf("the top names a backing file: %s", out)
	}
	qemuIO(t, []string{p, base}, "write -P 0xbb 1M 1M")
	// A snapshot stacked disk.2.qcow2 and its worker died before the
	// state named the ended top: the guest wrote on in the new one.
	next := topFile(upper, 2)
	if err := create(ctx, next, 64<<20); err != nil {
		t.Fatal(err)
	}
	qemuIO(t, []string{next, p, base}, "write -P 0xcc 2M 1M")
	if p2, err := top(ctx, upper, []string{base}, 0); err != nil || p2 != p {
		t.Fatalf("top after a snapshot's leftover: %q %v", p2, err)
	}
	if _, err := os.Stat(next); !os.IsNotExist(err) {
		t.Fatalf("the leftover top is still there: %v", err)
	}
	out := qemuIO(t, []string{p, base}, "read -P 0xaa 0 1M", "read -P 0xbb 1M 1M", "read -P 0xcc 2M 1M", "read -P 0 3M 1M")
	if strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("the merged disk: %s", out)
	}
	// Its state came to name the ended top's blob: the next start makes
	// a top over the chain of 2, and the ended top's file goes.
	diff := filepath.Join(dir, "diff.qcow2")
	if b, err := os.ReadFile(p); err != nil || os.WriteFile(diff, b, 0o600) != nil {
		t.Fatal(err)
	}
	p2, err := top(ctx, upper, []string{diff, base}, 0)
	if err != nil || p2 != topFile(upper, 2) {
		t.Fatalf("top over a chain of 2: %q %v", p2, err)
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Errorf("the ended top %s is still there: %v", p, err)
	}
	out = qemuIO(t, []string{p2, diff, base}, "read -P 0xaa 0 1M", "read -P 0xbb 1M 1M", "read -P 0xcc 2M 1M")
	if strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("the disk over the chain of 2: %s", out)
	}
	// A snapshot flattened the chain while the disk ran on its 5th top:
	// the chain is the flattened image alone, and the top (with a
	// snapshot's leftover over it) is renumbered the chain's, the ended
	// tops between gone.
	flat := filepath.Join(dir, "flat.qcow2")
	if out, err := exec.Command("qemu-img", "convert", "-q", "-O", "qcow2", chainSpec(p2, diff, base), flat).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	os.Rename(p2, topFile(upper, 5))
	qemuIO(t, []string{topFile(upper, 5), flat}, "write -P 0xdd 3M 1M")
	for _, k := range []int{2, 3, 4, 6} { // ended tops left behind, and a snapshot's leftover
		if err := create(ctx, topFile(upper, k), 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	qemuIO(t, []string{topFile(upper, 6), topFile(upper, 5), flat}, "write -P 0xee 4M 1M")
	p3, err := top(ctx, upper, []string{flat}, 5)
	if err != nil || p3 != topFile(upper, 1) {
		t.Fatalf("top over a flattened chain: %q %v", p3, err)
	}
	for _, k := range []int{2, 3, 4, 5, 6} {
		if _, err := os.Stat(topFile(upper, k)); !os.IsNotExist(err) {
			t.Errorf("top %d is still there: %v", k, err)
		}
	}
	out = qemuIO(t, []string{p3, flat}, "read -P 0xaa 0 1M", "read -P 0xbb 1M 1M", "read -P 0xcc 2M 1M", "read -P 0xdd 3M 1M", "read -P 0xee 4M 1M")
	if strings.Contains(out, "Pattern verification failed") {
		t.Fatalf("the disk over the flattened chain: %s", out)
	}
	// A start that renumbered it and went no further: found as it is.
	if p4, err := top(ctx, upper, []string{flat}, 5); err != nil || p4 != p3 {
		t.Fatalf("top after a renumbering: %q %v", p4, err)
	}
	// Neither the top it names nor the chain's: refused, nothing made.
	os.Remove(p3)
	if _, err := top(ctx, upper, []string{flat}, 5); err == nil {
		t.Error("a start with no top where its state says the disk was: no error")
	}
	if _, err := os.Stat(p3); !os.IsNotExist(err) {
		t.Errorf("an empty top was made: %v", err)
	}
}

// TestAgentDiskSame: the agent's disk made again, elsewhere and later,
// is the same bytes (its UUID, hash seed and times the agent's): a
// guest saved running, which may read it again after a restore, finds
// the blocks it knew.
func TestAgentDiskSame(t *testing.T) {
	agent := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(agent, bytes.Repeat([]byte("agent binary "), 100000), 0o755); err != nil {
		t.Fatal(err)
	}
	var disks [][]byte
	for range 2 {
		p, err := agentDisk(context.Background(), t.TempDir(), agent)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		disks = append(disks, b)
		time.Sleep(1100 * time.Millisecond) // a second later: no time of the clock's on it
	}
	if !bytes.Equal(disks[0], disks[1]) {
		t.Error("the agent's disk, made twice of one binary, differs")
	}
}
