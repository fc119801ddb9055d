package kube

import (
	"slices"
	"testing"

	discoveryv1 "k8s.io/api/discovery/v1"
)

func TestWorkers(t *testing.T) {
	port := func(name string, n int32) discoveryv1.EndpointPort {
		return discoveryv1.EndpointPort{Name: &name, Port: &n}
	}
	yes, no := true, false
	ep := func(terminating *bool, addrs ...string) discoveryv1.Endpoint {
		return discoveryv1.Endpoint{Addresses: addrs, Conditions: discoveryv1.EndpointConditions{Terminating: terminating}}
	}
	for _, tc := range []struct {
		name  string
		slice discoveryv1.EndpointSlice
		want  []string
	}{
		{"named port", discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeIPv4,
			Ports:     []discoveryv1.EndpointPort{port("metrics", 9090), port("api", 7443)},
			Endpoints: []discoveryv1.Endpoint{ep(nil, "10.0.0.1"), ep(&no, "10.0.0.2")}},
			[]string{"tcp://10.0.0.1:7443", "tcp://10.0.0.2:7443"}},
		{"one port, any name", discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeIPv4,
			Ports: []discoveryv1.EndpointPort{port("", 7443)}, Endpoints: []discoveryv1.Endpoint{ep(nil, "10.0.0.1")}},
			[]string{"tcp://10.0.0.1:7443"}},
		{"ipv6", discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeIPv6,
			Ports: []discoveryv1.EndpointPort{port("api", 7443)}, Endpoints: []discoveryv1.Endpoint{ep(nil, "fd00::1")}},
			[]string{"tcp://[fd00::1]:7443"}},
		{"terminating left out", discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeIPv4,
			Ports: []discoveryv1.EndpointPort{port("api", 7443)}, Endpoints: []discoveryv1.Endpoint{ep(&yes, "10.0.0.1"), ep(nil, "10.0.0.3")}},
			[]string{"tcp://10.0.0.3:7443"}},
		{"no such port", discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeIPv4,
			Ports: []discoveryv1.EndpointPort{port("metrics", 9090), port("other", 1)}, Endpoints: []discoveryv1.Endpoint{ep(nil, "10.0.0.1")}},
			nil},
		{"fqdn", discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeFQDN,
			Ports: []discoveryv1.EndpointPort{port("api", 7443)}, Endpoints: []discoveryv1.Endpoint{ep(nil, "w.example")}},
			nil},
		{"not an address", discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeIPv4,
			Ports: []discoveryv1.EndpointPort{port("api", 7443)}, Endpoints: []discoveryv1.Endpoint{ep(nil, "w.example", "10.0.0.9")}},
			[]string{"tcp://10.0.0.9:7443"}},
	} {
		if got := Workers(&tc.slice, "api"); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestDiscoverRefuses(t *testing.T) {
	for _, svc := range []string{"a/b/c", "/b", "ns/"} {
		if _, err := Discover(Config{Service: svc, Kubeconfig: "/nonexistent"}); err == nil {
			t.Errorf("service %q: no error", svc)
		}
	}
}
