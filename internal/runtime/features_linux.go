package runtime

import (
	"errors"
	"os"
	"strings"

	"github.com/dsec-project/dsec/internal/feature"
	"github.com/dsec-project/dsec/internal/runtime/disk"
)

// OnlineGrow is growing a mounted disk quota, which takes
// CAP_SYS_RESOURCE (package feature).
var OnlineGrow = feature.New("online disk grow", "a running sandbox's disk quota grows only once it is stopped and started (offline)", func() error {
	if !disk.HasCapSysResource() {
		return errors.New("the worker lacks CAP_SYS_RESOURCE")
	}
	return nil
})

// Swap is a swap device in use (a compressed tier such as zram): without
// one, a sandbox's anonymous memory is never given back (package
// feature).
var Swap = feature.New("swap", "an idle sandbox, or one hinted idle, gives back only its page cache; its anonymous memory stays (a compressed swap such as zram lets it go: dsec help operations)", func() error {
	b, err := os.ReadFile("/proc/swaps")
	if err != nil {
		return err
	}
	if !swapOn(b) {
		return errors.New("no swap is on (/proc/swaps)")
	}
	return nil
})

// swapOn says whether /proc/swaps lists a device: a line past its header.
func swapOn(b []byte) bool {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return len(lines) > 1
}
