package gateway

import (
	"fmt"
	"testing"
	"time"
)

// TestHomes: every gateway picks a name's home alike, whatever order
// it holds the workers in; a worker down is passed over; a worker
// leaving moves only the names whose home it was, and the names spread
// over the workers.
func TestHomes(t *testing.T) {
	var nodes []*node
	for i := range 4 {
		nodes = append(nodes, &node{Worker: Worker{URL: fmt.Sprintf("tcp://10.0.0.%d:7443", i+1)}, seen: time.Now()})
	}
	reversed := []*node{nodes[3], nodes[2], nodes[1], nodes[0]}
	count := map[*node]int{}
	for i := range 400 {
		name := fmt.Sprint("sb-", i)
		a, b := homes(nodes, name), homes(reversed, name)
		if len(a) != 4 || a[0] != b[0] || a[1] != b[1] {
			t.Fatalf("%s's homes differ by the fleet's order: %v %v", name, a, b)
		}
		count[a[0]]++
		// Without the third worker: a name homed elsewhere stays there;
		// one homed on it goes to its second.
		without := homes([]*node{nodes[0], nodes[1], nodes[3]}, name)
		if want := a[0]; want == nodes[2] {
			want = a[1]
			if without[0] != want {
				t.Errorf("%s: home %s once its first left, want its second %s", name, without[0].URL, want.URL)
			}
		} else if without[0] != want {
			t.Errorf("%s moved from %s to %s when another worker left", name, want.URL, without[0].URL)
		}
	}
	for _, n := range nodes {
		if count[n] < 60 {
			t.Errorf("%s is home to %d of 400 names: they do not spread", n.URL, count[n])
		}
	}
	nodes[1].down = true
	for i := range 50 {
		for _, h := range homes(nodes, fmt.Sprint("sb-", i)) {
			if h == nodes[1] {
				t.Fatal("a worker down is a home")
			}
		}
	}
}
