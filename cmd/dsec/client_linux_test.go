package main

import (
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"testing"

	"github.com/rogpeppe/go-internal/testscript"

	"github.com/dsec-project/dsec/internal/layer/lazy"
)

// buildClient builds the client (the front tag) into a directory of its
// own, as make build does.
func buildClient(t *testing.T) string {
	t.Helper()
	gobin := filepath.Join(goruntime.GOROOT(), "bin", "go")
	dir := t.TempDir()
	cmd := exec.Command(gobin, "build", "-tags", "front", "-o", filepath.Join(dir, "dsec"), ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build -tags front: %v\n%s", err, out)
	}
	return dir
}

// TestClientScripts runs testdata/client with the client build as dsec
// and this test binary (the complete dsec) as the dsecd on PATH.
func TestClientScripts(t *testing.T) {
	dir := buildClient(t)
	testscript.Run(t, scriptParams("testdata/client", func(env *testscript.Env) error {
		env.Setenv("CLIENT", dir)
		env.Setenv("PATH", dir+string(os.PathListSeparator)+env.Getenv("PATH"))
		return nil
	}))
}

// TestClientImports keeps the client build free of the packages that
// make a start slow: none of the runtime, layers, mounts or policy
// enforcement, nor what they import.
func TestClientImports(t *testing.T) {
	gobin := filepath.Join(goruntime.GOROOT(), "bin", "go")
	out, err := exec.Command(gobin, "list", "-deps", "-tags", "front", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	heavy := []string{"github.com/dsec-project/dsec/internal/runtime", "github.com/dsec-project/dsec/internal/layer",
		"github.com/dsec-project/dsec/internal/mount", "github.com/dsec-project/dsec/internal/policy",
		"github.com/dsec-project/dsec/internal/snap", "oras.land/", "github.com/hanwen/go-fuse", "github.com/cilium/ebpf",
		"github.com/elastic/go-seccomp-bpf", "github.com/erofs/", "github.com/klauspost/compress", "github.com/schollz/progressbar"}
	var deps int
	for _, pkg := range strings.Fields(string(out)) {
		deps++
		for _, h := range heavy {
			if strings.HasPrefix(pkg, h) {
				t.Errorf("the client build imports %s: keep it in the complete binary's files (//go:build !front)", pkg)
			}
		}
	}
	if deps < 50 { // net/http alone brings more: go list said too little
		t.Fatalf("go list -deps listed %d packages: %s", deps, out)
	}
}

func TestDefaultReadAhead(t *testing.T) {
	if defaultReadAheadKB != lazy.DefaultReadAheadKB {
		t.Fatalf("defaultReadAheadKB %d differs from lazy.DefaultReadAheadKB %d", defaultReadAheadKB, lazy.DefaultReadAheadKB)
	}
}
