package vmm

import (
	"os"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// MaybeRun runs the shim and never returns if this process was started
// as one (StartVM); otherwise it returns at once.
func MaybeRun() {
	if os.Getenv(vmmEnv) == "1" {
		initproto.Run("dsec vmm", runVMM)
	}
}
