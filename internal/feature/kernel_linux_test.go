package feature

import (
	"fmt"
	"strings"
	"testing"
)

func TestKernelVersion(t *testing.T) {
	major, minor := KernelVersion()
	if Kernel() == "" || major < 3 || minor < 0 || !strings.HasPrefix(Kernel(), fmt.Sprintf("%d.%d", major, minor)) {
		t.Fatalf("release %q read as %d.%d", Kernel(), major, minor)
	}
}
