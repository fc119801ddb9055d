package feature

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// Kernel is the running kernel's release, as uname -r says it, read
// once ("" if uname fails).
var Kernel = sync.OnceValue(func() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
})

// KernelVersion is the running kernel's major and minor version.
func KernelVersion() (major, minor int) {
	fmt.Sscanf(Kernel(), "%d.%d", &major, &minor)
	return major, minor
}
