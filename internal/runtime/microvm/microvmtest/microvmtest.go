// Package microvmtest gives tests what a microVM needs: the guest kernel
// make kernel unpacked (bin/microvm in the repository), and a static
// dsec-init for the guest's agent, built once per test process (a test
// binary, built with -race, cannot be the guest's: it needs the host's
// libraries).
package microvmtest

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/testenv"
)

// Settings are the microvm settings of a test's worker: the guest under
// TCG on this host, or wherever the machine's accelerator says.
func Settings(tb testing.TB) microvm.Settings {
	tb.Helper()
	testenv.RequireRoot(tb, "QEMU guests in cgroups, mounts")
	dir := KernelDir(tb)
	return microvm.Settings{Kernel: dir, Agent: Agent(tb)}
}

// repo is the repository's root (the directory holding go.mod).
func repo(tb testing.TB) string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "..")
}

// KernelDir is the guest kernel make kernel unpacks: a test without one
// fails under CI and skips, saying so, elsewhere.
func KernelDir(tb testing.TB) string {
	tb.Helper()
	dir := os.Getenv("DSEC_MICROVM_KERNEL")
	if dir == "" {
		dir = filepath.Join(repo(tb), "bin", "microvm")
	}
	if _, err := microvm.OpenKernel(dir); err != nil {
		if testenv.MustRun() {
			tb.Fatalf("no guest kernel for the microVM tests: %v (make test runs make kernel first)", err)
		}
		tb.Skipf("SKIPPED: no guest kernel (%v): run make kernel", err)
	}
	return dir
}

var (
	agentOnce sync.Once
	agentPath string
	agentErr  []byte
)

// Agent is a static dsec-init built from this tree.
func Agent(tb testing.TB) string {
	tb.Helper()
	agentOnce.Do(func() {
		cache, err := os.UserCacheDir()
		if err != nil {
			agentErr = []byte(err.Error())
			return
		}
		base := filepath.Join(cache, "dsec-test")
		if err := os.MkdirAll(base, 0o755); err != nil {
			agentErr = []byte(err.Error())
			return
		}
		// Built aside, then kept under its hash: test binaries of other
		// packages build it at the same time.
		tmp, err := os.MkdirTemp(base, ".agent-")
		if err != nil {
			agentErr = []byte(err.Error())
			return
		}
		defer os.RemoveAll(tmp)
		p := filepath.Join(tmp, "dsec-init")
		cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-trimpath", "-o", p, "./cmd/dsec-init")
		cmd.Dir = repo(tb)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = append([]byte(err.Error()+": "), out...)
			return
		}
		b, err := os.ReadFile(p)
		if err != nil {
			agentErr = []byte(err.Error())
			return
		}
		sum := sha256.Sum256(b)
		dir := filepath.Join(base, "agent-"+hex.EncodeToString(sum[:8]))
		if _, err := os.Stat(filepath.Join(dir, "dsec-init")); err != nil {
			os.Rename(tmp, dir) // another process's, if it lost the race: the same bytes
		}
		agentPath = filepath.Join(dir, "dsec-init")
	})
	if agentPath == "" {
		tb.Fatalf("build the guest's agent: %s", agentErr)
	}
	return agentPath
}
