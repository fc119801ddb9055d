// Command dsec-init is a sandbox's init (pid 1 in its namespaces), a
// microVM's shim on the host, and in its guest the agent: the worker
// starts it as one of them, and each returns unless it was.
package main

import (
	"fmt"
	"os"

	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
)

func main() {
	container.MaybeInit()
	vmm.MaybeRun()
	agent.MaybeRun()
	fmt.Fprintln(os.Stderr, "dsec-init: the worker starts this as a sandbox's init; it is not a command")
	os.Exit(2)
}
