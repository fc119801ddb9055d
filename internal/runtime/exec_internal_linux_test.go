package runtime

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestInitFailure: what a dead init last reported is found in its log,
// past the goroutine dumps a Go fatal error writes after its line; a log
// without a report gives nothing.
func TestInitFailure(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "init.log")
	for _, c := range []struct{ log, want string }{
		{"", ""},
		{"a command's own noise\nmore\n", ""},
		{"dsec init: read spec: unexpected end of JSON input\n", "dsec init: read spec: unexpected end of JSON input"},
		{"old\ndsec init: first\nruntime: failed to create new OS thread (have 9 already; errno=11)\nruntime: may need to increase max user processes (ulimit -u)\n" +
			"fatal error: newosproc\n\ngoroutine 1 [running]:\nruntime.throw()\n" + strings.Repeat("\t/usr/lib/go/src/runtime/panic.go:1023 +0x5c\n", 3000),
			"fatal error: newosproc"},
	} {
		if err := os.WriteFile(p, []byte(c.log), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := initFailure(p); got != c.want {
			t.Errorf("%.40q: %q, want %q", c.log, got, c.want)
		}
	}
	if got := initFailure(filepath.Join(dir, "none")); got != "" {
		t.Errorf("no log: %q", got)
	}
}
