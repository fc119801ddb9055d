package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/rogpeppe/go-internal/testscript"
)

// docPages are the pages whose marked examples run: the front page and
// every page under docs/ (the generated references hold none).
func docPages(t *testing.T) []string {
	t.Helper()
	pages := []string{"../../README.md"}
	err := filepath.WalkDir("../../docs", func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "reference" {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			pages = append(pages, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return pages
}

// TestExamples runs every example the documentation marks (a fenced
// block of "sh example" or "python example"), page by page, as a new
// user would: in an empty directory, with a fresh root (DSEC_ROOT), dsec
// on PATH, and a small busybox tree in $DSEC_EXAMPLE_BASE to build a base
// layer from. A page's sh blocks run in order in one bash -euo pipefail,
// then its python blocks with the repository's SDK (its worker started
// as any dsec command starts it); whatever the page
// left running is removed, and anything left after that is a leak. The
// Python examples under python/examples run likewise, on a base layer.
func TestExamples(t *testing.T) {
	dir := t.TempDir()
	n := 0
	for _, page := range docPages(t) {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		var sh, py strings.Builder
		for _, e := range examples(b) {
			w := &sh
			if e.Lang == "python" {
				w = &py
			}
			fmt.Fprintf(w, "# %s:%d\n%s", strings.TrimPrefix(page, "../../"), e.Line, e.Code)
		}
		if sh.Len() == 0 && py.Len() == 0 {
			continue
		}
		writeExampleScript(t, dir, strings.TrimPrefix(page, "../../"), sh.String(), py.String())
		n++
	}
	pyExamples, _ := filepath.Glob("../../python/examples/*.py")
	for _, p := range pyExamples {
		// Each takes the layers to run on: the base the script builds.
		name := strings.TrimPrefix(p, "../../")
		writeExampleScript(t, dir, name, "dsec layer build \"$DSEC_EXAMPLE_BASE\" --kind base -t example-base:1 >/dev/null\n",
			fmt.Sprintf("import runpy, sys\nsys.argv = [%q, \"example-base:1\"]\nrunpy.run_path(%q, run_name=\"__main__\")\n", name, mustAbs(t, p)))
		n++
	}
	if n == 0 {
		t.Fatal("no page marks an example: the front page's first sandbox should")
	}
	testscript.Run(t, scriptParams(dir, nil))
}

// writeExampleScript writes the testscript that runs one page's examples.
func writeExampleScript(t *testing.T, dir, page, sh, py string) {
	t.Helper()
	var s strings.Builder
	fmt.Fprintf(&s, "# The examples of %s.\n", page)
	s.WriteString("[!root] skip 'the examples start a worker, which needs root; CI runs as root, so they never skip there'\n")
	s.WriteString("mkbusybox base\nexec sh -c 'echo root:x:0:0:root:/root:/bin/sh > base/etc/passwd'\n")
	s.WriteString("env DSEC_EXAMPLE_BASE=$WORK/base\nmkdir run\ncd run\n")
	if sh != "" {
		// In a network namespace of its own, loopback up: the ports a
		// page listens on (7443 in the TCP examples) are its own, whatever
		// else the host runs meanwhile.
		s.WriteString("exec unshare --net -- sh -c 'ip link set lo up && exec bash -euo pipefail \"$0\"' $WORK/example.sh\n")
	}
	if py != "" {
		// The SDK talks to a running worker: a command of dsec starts one.
		s.WriteString("exec dsec ps\nenv PYTHONPATH=$DSEC_PYTHON\nexec python3 $WORK/example.py\n")
	}
	fmt.Fprintf(&s, "-- example.sh --\n%s-- example.py --\n%s", sh, py)
	name := regexp.MustCompile(`[^a-zA-Z0-9]+`).ReplaceAllString(strings.TrimSuffix(page, filepath.Ext(page)), "_")
	if err := os.WriteFile(filepath.Join(dir, name+".txtar"), []byte(s.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustAbs(t *testing.T, p string) string {
	t.Helper()
	abs, err := filepath.Abs(p)
	if err != nil {
		t.Fatal(err)
	}
	return abs
}
