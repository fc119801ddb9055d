package microvmtest

import "testing"

// TestLockupReport: the kernel's reports of a stuck CPU, and only they,
// do not count as a guest's progress.
func TestLockupReport(t *testing.T) {
	for line, want := range map[string]bool{
		"[   24.508954] rcu: INFO: rcu_preempt self-detected stall on CPU":            true,
		"[   24.509744] rcu: \t0-....: (1 GPs behind) idle=8c84/1/0x4000000000000000": true,
		"[   52.479928] watchdog: BUG: soft lockup - CPU#0 stuck for 48s! [init:1]":   true,
		"[    0.412345] rcu: Hierarchical SRCU implementation.":                       true, // (at boot: the watch has just begun)
		"=== RUN   TestProtect":                         false,
		"[    1.000000] Run /init as init process":      false,
		"--- PASS: TestPidsLimit (0.21s)":               false,
		"[    2.000000] watchdog: disabled (a setting)": false,
	} {
		if got := lockupReport(line); got != want {
			t.Errorf("%q: %v, want %v", line, got, want)
		}
	}
}
