//go:build !front

package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/dsec-project/dsec/api"
)

// TestPrintTreeCycle: a lineage a store made cyclic (issue 29, item 0:
// snap ls --tree printed until the OOM killer came) draws each snapshot
// once.
func TestPrintTreeCycle(t *testing.T) {
	var out bytes.Buffer
	a := &app{stdout: &out}
	nodes := []api.SnapshotNode{
		{Name: "loop1:1", Parent: "bb:1", Children: []string{"loop1:2"}},
		{Name: "loop1:2", Parent: "loop1:1", Children: []string{"loop1:2", "loop1:1"}, Branches: []string{"b-1"}},
	}
	if err := a.printTree(nodes); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	if strings.Count(got, "\n") > 8 || strings.Count(got, "loop1:2  (0 B") != 1 || !strings.Contains(got, "(drawn above)") {
		t.Fatalf("tree:\n%s", got)
	}
}
