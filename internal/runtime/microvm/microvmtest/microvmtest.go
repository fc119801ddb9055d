// Package microvmtest gives tests what a microVM needs: the guest kernel
// make kernel unpacked (bin/microvm in the repository), and a static
// dsec-init for the guest's agent, built once per test process (a test
// binary, built with -race, cannot be the guest's: it needs the host's
// libraries).
package microvmtest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
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
// TCG on this host, or wherever the machine's accelerator says. A test
// without a guest kernel fails under CI and skips, saying so, elsewhere.
func Settings(tb testing.TB) microvm.Settings {
	tb.Helper()
	testenv.RequireRoot(tb, "QEMU guests in cgroups, mounts")
	kernel, agent, err := Find()
	if err != nil {
		if testenv.MustRun() || kernel != "" {
			tb.Fatal(err)
		}
		tb.Skipf("SKIPPED: %v", err)
	}
	return microvm.Settings{Kernel: kernel, Agent: agent}
}

// Find finds the guest kernel (DSEC_MICROVM_KERNEL, else the
// repository's bin/microvm) and builds the agent; an error with no
// kernel says how to get one.
func Find() (kernel, agent string, err error) {
	kernel = os.Getenv("DSEC_MICROVM_KERNEL")
	if kernel == "" {
		kernel = filepath.Join(repo(), "bin", "microvm")
	}
	if _, err := microvm.OpenKernel(kernel); err != nil {
		return "", "", fmt.Errorf("no guest kernel for the microVM tests: %v (make test runs make kernel first)", err)
	}
	agent, err = Agent()
	return kernel, agent, err
}

// repo is the repository's root (the directory holding go.mod).
func repo() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "..")
}

var (
	agentOnce sync.Once
	agentPath string
	agentErr  error
)

// Agent is a static dsec-init built from this tree, once per process,
// kept in the user's cache under its hash (test binaries of other
// packages build it at the same time).
func Agent() (string, error) {
	agentOnce.Do(func() { agentPath, agentErr = buildAgent() })
	return agentPath, agentErr
}

func buildAgent() (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	base := filepath.Join(cache, "dsec-test")
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(base, ".agent-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	p := filepath.Join(tmp, "dsec-init")
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-trimpath", "-o", p, "./cmd/dsec-init")
	cmd.Dir = repo()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the guest's agent: %v: %s", err, out)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	dir := filepath.Join(base, "agent-"+hex.EncodeToString(sum[:8]))
	if _, err := os.Stat(filepath.Join(dir, "dsec-init")); err != nil {
		os.Rename(tmp, dir) // another process's, if it won the race: the same bytes
	}
	return filepath.Join(dir, "dsec-init"), nil
}
