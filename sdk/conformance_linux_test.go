package sdk_test

import (
	"testing"

	"github.com/dsec-project/dsec/internal/runtime/backend/backendtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestContainerBackend holds the container backend to the conformance
// suite every backend passes.
func TestContainerBackend(t *testing.T) {
	backendtest.Run(t, func(t *testing.T) *backendtest.Env {
		w, c := setup(t)
		return &backendtest.Env{
			Backend: "container",
			Layers:  []string{"ws:1", "bb:1"},
			Client:  c,
			Restart: func(t *testing.T) *sdk.Client {
				w.Kill()
				w = runtimetest.StartWorker(t, w.Root)
				c, err := sdk.New(sdk.Options{Root: w.Root})
				if err != nil {
					t.Fatal(err)
				}
				return c
			},
			Leftovers: func() []string { return runtimetest.Leftovers(w.Root) },
		}
	})
}
