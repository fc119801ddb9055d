package runtime

import "testing"

func TestSwapOn(t *testing.T) {
	for _, tc := range []struct {
		swaps string
		on    bool
	}{
		{"Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n", false},
		{"", false},
		{"Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n/dev/zram0                              partition\t4194300\t\t0\t\t-2\n", true},
	} {
		if got := swapOn([]byte(tc.swaps)); got != tc.on {
			t.Errorf("swapOn(%q) = %v, want %v", tc.swaps, got, tc.on)
		}
	}
}
