// Package testenv says what a test may assume of the machine it runs
// on. CI runs every test as root: there a test that needs root fails
// rather than skip, so no privileged test passes by skipping.
package testenv

import (
	"os"
	"testing"
)

// MustRun says whether tests must run whatever they need: under CI (CI
// or DSEC_REQUIRE_ROOT set, as .ci/run does).
func MustRun() bool { return os.Getenv("DSEC_REQUIRE_ROOT") != "" || os.Getenv("CI") != "" }

// RequireRoot skips tb, loudly, unless it runs as root; under CI it
// fails instead.
func RequireRoot(tb testing.TB, why string) {
	tb.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if MustRun() {
		tb.Fatalf("needs root (%s), and CI must run it: run the tests as root", why)
	}
	tb.Skipf("SKIPPED: needs root (%s); CI runs it as root", why)
}
