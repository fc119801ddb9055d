//go:build !front

package main

import (
	"reflect"
	"strings"
	"testing"
)

// TestGatewayWorkers: --worker-token and --worker-ca go with --worker
// once for all or once each, in order; any other count is refused.
func TestGatewayWorkers(t *testing.T) {
	urls := []string{"tcp://a:1", "tcp://b:2"}
	for _, c := range []struct {
		tokens, cas []string
		want        []GatewayWorker
		err         string
	}{
		{[]string{"t"}, nil, []GatewayWorker{{URL: "tcp://a:1", Token: "t"}, {URL: "tcp://b:2", Token: "t"}}, ""},
		{[]string{"t1", "t2"}, []string{"ca"}, []GatewayWorker{{URL: "tcp://a:1", Token: "t1", CA: "ca"}, {URL: "tcp://b:2", Token: "t2", CA: "ca"}}, ""},
		{nil, []string{"c1", "c2"}, []GatewayWorker{{URL: "tcp://a:1", CA: "c1"}, {URL: "tcp://b:2", CA: "c2"}}, ""},
		{[]string{"t1", "t2", "t3"}, nil, nil, "3 --worker-token for 2 --worker"},
		{[]string{"t"}, []string{"c1", "c2", "c3"}, nil, "3 --worker-ca for 2 --worker"},
	} {
		got, err := gatewayWorkers(urls, map[string][]string{"worker-token": c.tokens, "worker-ca": c.cas})
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%v %v: %v, want %q", c.tokens, c.cas, err, c.err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("%v %v: %+v %v, want %+v", c.tokens, c.cas, got, err, c.want)
		}
	}
}
