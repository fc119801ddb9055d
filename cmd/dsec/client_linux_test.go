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
	"github.com/dsec-project/dsec/internal/runtime/container"
)

// goBuild builds a binary of this module as make build does.
func goBuild(t *testing.T, out string, args ...string) {
	t.Helper()
	gobin := filepath.Join(goruntime.GOROOT(), "bin", "go")
	cmd := exec.Command(gobin, append([]string{"build", "-o", out}, args...)...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %v: %v\n%s", args, err, b)
	}
}

// TestClientScripts runs testdata/client with the client build as dsec,
// this test binary (the complete dsec) as the dsecd on PATH, and the
// sandboxes' own init binary as the worker's.
func TestClientScripts(t *testing.T) {
	dir, initDir := t.TempDir(), t.TempDir()
	goBuild(t, filepath.Join(dir, "dsec"), "-tags", "front", ".")
	goBuild(t, filepath.Join(initDir, container.InitName), "../dsec-init")
	testscript.Run(t, scriptParams("testdata/client", func(env *testscript.Env) error {
		env.Setenv("CLIENT", dir)
		env.Setenv("PATH", dir+string(os.PathListSeparator)+env.Getenv("PATH"))
		env.Setenv(container.InitBinaryEnv, filepath.Join(initDir, container.InitName))
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
