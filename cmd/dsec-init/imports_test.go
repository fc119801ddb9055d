package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestInitImports keeps the sandboxes' init free of what it never runs:
// every package a process links is initialised when it starts, and an
// init starts for every sandbox. The drivers' packages (layers,
// policies, networks) and net/http (TLS, HTTP/2) once made it 146
// packages to initialise where 57 do.
func TestInitImports(t *testing.T) {
	cmd := exec.Command("go", "list", "-deps", ".") // go test puts its go first on PATH
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0") // as make build builds it
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	heavy := []string{"net/http", "crypto/tls", "github.com/dsec-project/dsec/internal/layer",
		"github.com/dsec-project/dsec/internal/policy", "github.com/dsec-project/dsec/internal/egress",
		"github.com/dsec-project/dsec/internal/runtime/driver/shim", "github.com/dsec-project/dsec/internal/runtime/network",
		"github.com/dsec-project/dsec/internal/runtime/cgroup", "github.com/cilium/ebpf", "github.com/miekg/dns",
		"github.com/google/nftables", "github.com/elastic/go-seccomp-bpf", "github.com/erofs/", "github.com/klauspost/compress"}
	var deps int
	for _, pkg := range strings.Fields(string(out)) {
		deps++
		for _, h := range heavy {
			if pkg == h || strings.HasPrefix(pkg, strings.TrimSuffix(h, "/")+"/") {
				t.Errorf("dsec-init imports %s: keep what only the worker runs out of the init's packages", pkg)
			}
		}
	}
	if deps < 30 { // os and syscall alone bring more: go list said too little
		t.Fatalf("go list -deps listed %d packages: %s", deps, out)
	}
}
