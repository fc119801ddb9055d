package agent

import (
	"os"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// MaybeRun runs the guest's agent and never returns if this process is
// a microVM guest's pid 1 (the kernel's command line names GuestEnv);
// otherwise it returns at once.
func MaybeRun() {
	if os.Getenv(initproto.GuestEnv) == "1" && os.Getpid() == 1 {
		initproto.Run("dsec guest", runGuest)
	}
}
