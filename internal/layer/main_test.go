package layer_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// TestMain doubles as the build process that TestKillMidBuild kills.
func TestMain(m *testing.M) {
	if dir := os.Getenv("DSEC_HELPER_STORE"); dir != "" {
		s, err := store.Open(dir)
		if err == nil {
			ref, _ := layer.ParseRef("half:1")
			_, err = layer.Build(context.Background(), s, layer.BuildOptions{Source: "-", Stdin: os.Stdin, Kind: layer.KindBase, Ref: ref})
		}
		fmt.Fprintln(os.Stderr, "helper build returned:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}
