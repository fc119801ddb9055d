package layertest

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// registryVersion is the distribution registry the tests run.
const registryVersion = "v3.1.2"

// RegistryBinary returns the registry, built with go install on first use
// into the user cache, so CI and developers run the same real registry.
func RegistryBinary(t *testing.T) string {
	t.Helper()
	exe, err := Registry()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

// Registry is RegistryBinary for callers without a testing.T.
func Registry() (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(cache, "dsec-test", "registry-"+registryVersion)
	exe := filepath.Join(bin, "registry")
	if _, err := os.Stat(exe); err == nil {
		return exe, nil
	}
	goexe := filepath.Join(runtime.GOROOT(), "bin", "go")
	cmd := exec.Command(goexe, "install", "github.com/distribution/distribution/v3/cmd/registry@"+registryVersion)
	cmd.Env = append(os.Environ(), "GOBIN="+bin, "GOFLAGS=-mod=mod")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go install the test registry: %v\n%s", err, out)
	}
	return exe, nil
}

// StartRegistry runs a registry on 127.0.0.1 with storage in a temp dir
// and returns its host:port and storage root.
func StartRegistry(t *testing.T) (string, string) {
	t.Helper()
	return StartRegistryWith(t, "")
}

// StartRegistryWith adds extra top-level configuration.
func StartRegistryWith(t *testing.T, extra string) (string, string) {
	t.Helper()
	exe := RegistryBinary(t)
	dir := t.TempDir()
	addr, stop, err := RunRegistry(exe, dir, extra)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return addr, filepath.Join(dir, "data")
}

// RunRegistry runs the registry exe on 127.0.0.1 with its storage
// under dir/data, and returns its host:port and what stops it.
func RunRegistry(exe, dir, extra string) (string, func(), error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	addr := l.Addr().String()
	l.Close()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n%s", filepath.Join(dir, "data"), addr, extra)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", nil, err
	}
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return "", nil, err
	}
	var logs bytes.Buffer
	cmd := exec.Command(exe, "serve", cfgPath)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.Env = append(os.Environ(), "OTEL_TRACES_EXPORTER=none")
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop := func() {
		cmd.Process.Kill()
		cmd.Wait()
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 || resp.StatusCode == 401 {
				return addr, stop, nil
			}
		}
		if time.Now().After(deadline) {
			stop()
			return "", nil, fmt.Errorf("registry did not start: %v\n%s", err, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
